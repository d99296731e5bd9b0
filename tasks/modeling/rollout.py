"""Generation with transformers: student rollouts (sampled) and evaluation (greedy), left-padded prompts.

Every sequence tensor here is ``[B, P + R]``: a left-padded prompt block of width P, then R generated positions.

Real checkpoints differ from a tokenizer in two ways handled here. Their head may be padded past the tokenizer
(``config.vocab_size`` > ``len(tok)``, a multiple of 64 or 128): the real vocabulary is ``len(tok)``, generation never
emits an id past it (:class:`RealVocabulary`) and log-probs are taken over it alone. And they may stop on several
tokens (``generation_config.eos_token_id`` a list, e.g. ``<|im_end|>`` and ``<|endoftext|>``): :func:`eos_ids` is
that set, and a response ends at the first of any of them.

A model marked with :func:`compile_generation` generates with a static KV cache (preallocated once per call, no
per-token concatenation) and its decode step compiled by ``torch.compile`` (transformers' own path: a
``CompileConfig``; on the CPU as well as on GPUs). The first call of each shape compiles (seconds); later calls reuse
it, and the compiled step reads the model's current weights, so an optimizer step between calls needs no recompile.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Literal, NamedTuple

import torch
from transformers import (
    CompileConfig,
    GenerationConfig,
    LogitsProcessor,
    LogitsProcessorList,
    PreTrainedModel,
    PreTrainedTokenizerBase,
    StoppingCriteria,
    StoppingCriteriaList,
)

from tasks.modeling.device import autocast_for, model_device


def position_ids_from_mask(attention_mask_B_T: torch.Tensor) -> torch.Tensor:
    """Positions that skip left padding, as generation computes them (transformers 5 does not derive them itself)."""
    return (attention_mask_B_T.long().cumsum(-1) - 1).clamp(min=0)


class Span(NamedTuple):
    """A run of one row's sequence positions ``[start, end)`` and where its tokens came from: ``prompt`` (the
    route's rendering), ``student`` (sampled by the policy: the loss covers them) or ``external`` (inside the
    response but written by something else: a tool's result, an environment's turn; no loss, no teacher signal)."""

    start: int
    end: int
    source: Literal["prompt", "student", "external"]


@dataclass
class Rollout:
    sequences_B_T: torch.Tensor  # prompt (left-padded) + response tokens
    attention_mask_B_T: torch.Tensor  # 1 on real prompt tokens and on response tokens up to the first EOS
    response_mask_B_T: torch.Tensor  # 1 on response tokens up to and including the first EOS
    truncated_B: torch.Tensor  # True where the response hit the length cap without an EOS
    prompt_width: int
    # 1 on the tokens the loss covers (the student's own); None: every response token (the response mask), as for
    # a single-turn completion. A row with tokens from outside (a tool's result) keeps them out of this mask only.
    loss_tokens_B_T: torch.Tensor | None = None

    @property
    def response_lengths_B(self) -> torch.Tensor:
        return self.response_mask_B_T.sum(-1)

    def loss_mask_B_T(self) -> torch.Tensor:
        """Mask over hidden positions ``0..T-2`` whose *next* token is one the loss covers (the positions that predict
        a student token): :attr:`loss_tokens_B_T`, by default every response token."""
        tokens_B_T = self.response_mask_B_T if self.loss_tokens_B_T is None else self.loss_tokens_B_T
        return tokens_B_T[:, 1:]

    def response_span(self, row: int) -> tuple[int, int]:
        """Where row ``row``'s response starts and ends in :attr:`sequences_B_T` (``[start, end)``)."""
        return self.prompt_width, self.prompt_width + int(self.response_mask_B_T[row].sum())

    def spans(self, row: int) -> list[Span]:
        """Row ``row``'s real tokens as runs by where they came from (:class:`Span`), in order."""
        P = self.prompt_width
        first = int(self.attention_mask_B_T[row, :P].argmax()) if bool(self.attention_mask_B_T[row, :P].any()) else P
        out = [Span(first, P, "prompt")] if first < P else []
        loss_T = (self.response_mask_B_T if self.loss_tokens_B_T is None else self.loss_tokens_B_T)[row]
        start, end = self.response_span(row)
        for t in range(start, end):
            source = "student" if bool(loss_T[t]) else "external"
            if out and out[-1].source == source and out[-1].end == t:
                out[-1] = out[-1]._replace(end=t + 1)
            else:
                out.append(Span(t, t + 1, source))
        return out


# The token id, or the ids, that end a response (any one of them does).
Stop = int | Sequence[int]


def eos_ids(tok: PreTrainedTokenizerBase, model: PreTrainedModel | GenerationConfig | None = None) -> tuple[int, ...]:
    """The ids that end a response: the tokenizer's EOS, then every id of ``model``'s
    ``generation_config.eos_token_id`` (an int or a list: SmolLM2-style checkpoints stop on ``<|im_end|>`` and
    ``<|endoftext|>``; a ``GenerationConfig`` itself will do), without repeats. What generation stops on, and what
    masks and truncation flags read as the end."""
    ids = [tok.eos_token_id]
    extra = getattr(getattr(model, "generation_config", model), "eos_token_id", None)
    ids += [extra] if isinstance(extra, int) else list(extra or [])
    return tuple(dict.fromkeys(int(i) for i in ids if i is not None))


def is_eos(ids: torch.Tensor, eos: Stop) -> torch.Tensor:
    """Where ``ids`` holds one of the stop ids ``eos`` (a bool tensor of its shape)."""
    return torch.isin(ids, torch.tensor([eos] if isinstance(eos, int) else list(eos), dtype=ids.dtype))


def response_mask(generated_B_R: torch.Tensor, eos: Stop) -> torch.Tensor:
    """1 up to and including the first EOS (any id of ``eos``) of each row, 0 after it (all 1 when no EOS: a
    truncated response)."""
    is_eos_B_R = is_eos(generated_B_R, eos).long()
    after_first_eos = (is_eos_B_R.cumsum(-1) - is_eos_B_R) > 0
    return (~after_first_eos).long()


class RealVocabulary(LogitsProcessor):
    """Bans the ids of a padded head past the tokenizer's ``vocab_size`` (``-inf``): they are no token, and one
    generated would not decode, nor mean anything to a teacher."""

    def __init__(self, vocab_size: int):
        self.vocab_size = vocab_size

    def __call__(self, input_ids: torch.LongTensor, scores_B_V: torch.FloatTensor) -> torch.FloatTensor:
        if scores_B_V.shape[-1] > self.vocab_size:
            scores_B_V = scores_B_V.clone()
            scores_B_V[:, self.vocab_size:] = float("-inf")
        return scores_B_V


class RowSampler(LogitsProcessor):
    """Sampling row by row for transformers' ``generate`` run greedily: row b draws from ``softmax(scores /
    temperature_B[b])`` restricted to its nucleus (the fewest most likely tokens whose mass reaches ``top_p_B[b]``;
    1 = every token), or takes the argmax where its temperature is 0. Gumbel-max: the argmax of the tempered,
    truncated log-probabilities plus independent Gumbel noise ``-log E`` (``E ~ Exp(1)``) is an exact draw from that
    distribution. The noise comes from ``generator`` when given (a caller sampling in threads side by side stays
    reproducible; transformers' own sampling draws from torch's global generator, which every thread shares), else
    from torch's global one."""

    def __init__(self, temperature_B: Sequence[float] | float, top_p_B: Sequence[float] | float = 1.0,
                 generator: torch.Generator | None = None):
        self.temperature_B = torch.as_tensor(temperature_B, dtype=torch.float32).reshape(-1)
        self.top_p_B = torch.as_tensor(top_p_B, dtype=torch.float32).reshape(-1)
        self.generator = generator

    def __call__(self, input_ids: torch.LongTensor, scores_B_V: torch.FloatTensor) -> torch.FloatTensor:
        B = scores_B_V.shape[0]
        temp_B1 = self.temperature_B.expand(B)[:, None].to(scores_B_V.device, scores_B_V.dtype)
        greedy_B1 = temp_B1 == 0
        z_B_V = scores_B_V / torch.where(greedy_B1, torch.ones_like(temp_B1), temp_B1)
        top_p_B1 = self.top_p_B.expand(B)[:, None].to(scores_B_V.device)
        if bool((top_p_B1 < 1).any()):
            sorted_B_V, order_B_V = z_B_V.sort(dim=-1, descending=True)
            p_B_V = sorted_B_V.float().softmax(-1)
            # A token leaves the nucleus when the tokens ranked above it already hold top_p of the mass.
            out_sorted_B_V = (p_B_V.cumsum(-1) - p_B_V) >= top_p_B1
            out_B_V = torch.zeros_like(out_sorted_B_V).scatter(-1, order_B_V, out_sorted_B_V)
            z_B_V = z_B_V.masked_fill(out_B_V, float("-inf"))
        # Drawn where the generator lives (the CPU's, reproducible whatever the model's device), then moved.
        where = self.generator.device if self.generator is not None else "cpu"
        e_B_V = torch.empty(scores_B_V.shape, dtype=scores_B_V.dtype, device=where)
        e_B_V = e_B_V.exponential_(generator=self.generator).to(scores_B_V.device)
        # E = 0 would give +inf noise, and inf + (-inf) on a banned token a NaN that argmax picks.
        noise_B_V = -e_B_V.clamp_(min=torch.finfo(e_B_V.dtype).tiny).log()
        return z_B_V + noise_B_V.masked_fill(greedy_B1, 0.0)


class PrivateSampler(RowSampler):
    """:class:`RowSampler` at one temperature for every row, without top-p, drawing from ``generator``."""

    def __init__(self, temperature: float, generator: torch.Generator):
        super().__init__(temperature, 1.0, generator)


class StopStrings(StoppingCriteria):
    """Ends each row of a batch at its own stop strings (``stops_B[b]``; empty: none), for transformers' ``generate``:
    a row is done once the text of its newest tokens holds one of them (its later positions are then padding). Where
    exactly each response ends is :func:`cut_at_stops`'s to say, on the finished rollout."""

    def __init__(self, tok: PreTrainedTokenizerBase, prompt_width: int, stops_B: Sequence[Sequence[str]]):
        self.tok, self.P, self.stops_B = tok, prompt_width, [tuple(x) for x in stops_B]
        # Every token decodes to at least one character (or none, for a few specials): the newest tokens of this
        # many cover the longest stop string with room for a split character.
        self.tail = max((len(x) for row in self.stops_B for x in row), default=0) + 4

    def __call__(self, input_ids: torch.LongTensor, scores, **kwargs) -> torch.BoolTensor:
        done_B = torch.zeros(input_ids.shape[0], dtype=torch.bool, device=input_ids.device)
        for b, stops in enumerate(self.stops_B):
            if stops:
                text = self.tok.decode(input_ids[b, max(self.P, input_ids.shape[1] - self.tail):])
                done_B[b] = any(x in text for x in stops)
        return done_B


def stop_end(tok: PreTrainedTokenizerBase, ids: Sequence[int], stops: Sequence[str]) -> int | None:
    """How many of ``ids`` a response keeps when it ends at its first stop string: up to and including the token that
    completes one (None: the text holds none)."""
    if not stops or not any(x in tok.decode(list(ids)) for x in stops):
        return None
    lo, hi = 1, len(ids)  # the shortest prefix whose text holds a stop string
    while lo < hi:
        mid = (lo + hi) // 2
        if any(x in tok.decode(list(ids[:mid])) for x in stops):
            hi = mid
        else:
            lo = mid + 1
    return lo


def cut_at_stops(rollout: Rollout, tok: PreTrainedTokenizerBase, stops_B: Sequence[Sequence[str]], eos: Stop) -> Rollout:
    """Each row's response ended at its first stop string (``stops_B[b]``; empty: none): the token that completes it
    is the response's last (its text, from :func:`strip_stop`, ends before the stop string), later tokens leave both
    masks, and the row counts as ended, not truncated. Rows without a stop string are unchanged."""
    if not any(stops_B):
        return rollout
    P = rollout.prompt_width
    resp_B_R = rollout.response_mask_B_T[:, P:].clone()
    stopped_B = torch.zeros(resp_B_R.shape[0], dtype=torch.bool)
    for b, stops in enumerate(stops_B):
        end = stop_end(tok, rollout.sequences_B_T[b, P:P + int(resp_B_R[b].sum())].tolist(), stops)
        if end is not None:
            resp_B_R[b, end:] = 0
            stopped_B[b] = True
    out = _keep_external(_assemble(rollout.sequences_B_T, rollout.attention_mask_B_T[:, :P], resp_B_R, eos), rollout)
    out.truncated_B &= ~stopped_B
    return out


def strip_stop(text: str, stops: Sequence[str]) -> str:
    """``text`` before its first stop string (all of it without one): what a verifier reads, as vLLM returns it."""
    cut = min((i for i in (text.find(x) for x in stops) if i >= 0), default=len(text))
    return text[:cut]


_COMPILED_ATTR = "_opd_compiled_generation"  # an instance attribute, so that a deepcopy (the overlap's copy) keeps it


def compile_generation(model: PreTrainedModel, enabled: bool = True) -> PreTrainedModel:
    """Mark ``model`` so that :func:`generate` runs it with a static KV cache and a ``torch.compile``'d decode step
    (``enabled`` False clears the mark). Returns the model."""
    setattr(model, _COMPILED_ATTR, enabled)
    return model


def compiled_generation_kwargs(model: PreTrainedModel) -> dict:
    """``model.generate`` arguments for a model marked by :func:`compile_generation` (none otherwise)."""
    if not getattr(model, _COMPILED_ATTR, False):
        return {}
    # transformers caches the compiled call on the model (``_compiled_call``, bound to that model): a deepcopy (the
    # overlap's rollout copy) inherits the original's, which would sample from the original's live weights. A
    # model whose cached call was made for another object compiles its own.
    if getattr(model, "_opd_compiled_owner", None) != id(model):
        model.__dict__.pop("_compiled_call", None)
        model._opd_compiled_owner = id(model)
    config = CompileConfig(fullgraph=False, dynamic=None)
    # transformers compiles generate's decode step on CUDA by itself; elsewhere only when this flag is set (its
    # CompileConfig documents it as the switch for CPU compilation).
    config._compile_all_devices = model_device(model).type != "cuda"
    return dict(cache_implementation="static", compile_config=config)


@torch.no_grad()
def generate(
    model: PreTrainedModel,
    tok: PreTrainedTokenizerBase,
    prompts: list[str],
    max_new_tokens: int,
    greedy: bool = False,
    temperature: float | Sequence[float] = 1.0,
    generator: torch.Generator | None = None,
    top_p: float | Sequence[float] = 1.0,
    stop: Sequence[Sequence[str]] | None = None,
    prefixes: Sequence[Sequence[int]] | None = None,
) -> Rollout:
    """Sample or decode greedily one completion per prompt, stopping at any of :func:`eos_ids` and never emitting an
    id of a padded head past ``len(tok)`` (:class:`RealVocabulary`). ``temperature`` and ``top_p`` are one value or
    one per prompt (a mixed batch samples each route as its spec says; temperature 0 = greedy for that row; no top-k);
    ``stop``: each prompt's stop strings, which end its response as EOS does (:func:`cut_at_stops`). Samples draw
    from torch's global generator, or from ``generator`` when given (:class:`RowSampler`): code sampling in threads
    side by side passes its own to stay reproducible. The model runs on its own device, under its compute dtype's
    autocast (:func:`tasks.modeling.device.autocast_for`); the rollout comes back on the CPU.

    ``prefixes``: per prompt, token ids the response starts with, written by someone else (guided OPD: the start of
    a teacher's own solution; empty: none). The model continues after them; they stand at the head of the response
    as ``external`` tokens (out of :attr:`Rollout.loss_tokens_B_T`), and ``max_new_tokens`` counts the continuation
    alone."""
    was_training = model.training
    model.eval()
    if prefixes is not None and any(prefixes):
        ids = tok(prompts, add_special_tokens=False)["input_ids"]
        enc = tok.pad({"input_ids": [p + list(x) for p, x in zip(ids, prefixes)]}, padding_side="left",
                      return_tensors="pt")
    else:
        prefixes = None
        enc = tok(prompts, return_tensors="pt", padding=True, padding_side="left", add_special_tokens=False)
    processors = LogitsProcessorList([RealVocabulary(len(tok))])  # before the sampler: its noise keeps -inf banned
    uniform = isinstance(temperature, (int, float)) and isinstance(top_p, (int, float)) and top_p == 1.0
    if greedy:
        kwargs = dict(do_sample=False)
    elif generator is not None or not uniform:
        processors.append(RowSampler(temperature, top_p, generator))
        kwargs = dict(do_sample=False)
    else:
        kwargs = dict(do_sample=True, temperature=temperature, top_k=0, top_p=1.0)
    eos = eos_ids(tok, model)
    P = enc.input_ids.shape[1]
    stops_B = [tuple(x) for x in stop] if stop is not None else []
    if any(stops_B):
        kwargs["stopping_criteria"] = StoppingCriteriaList([StopStrings(tok, P, stops_B)])
    device = model_device(model)
    with autocast_for(model):
        out_B_T = model.generate(
            input_ids=enc.input_ids.to(device),
            attention_mask=enc.attention_mask.to(device),
            max_new_tokens=max_new_tokens,
            pad_token_id=tok.pad_token_id,
            eos_token_id=list(eos) or None,
            logits_processor=processors,
            **kwargs,
            **compiled_generation_kwargs(model),
        ).cpu()
    model.train(was_training)
    rollout = _assemble(out_B_T, enc.attention_mask, response_mask(out_B_T[:, P:], eos), eos)
    rollout = cut_at_stops(rollout, tok, stops_B, eos) if any(stops_B) else rollout
    return rollout if prefixes is None else with_prefixes(rollout, tok, prompts, prefixes, eos)


def with_prefixes(rollout: Rollout, tok: PreTrainedTokenizerBase, prompts: list[str],
                  prefixes: Sequence[Sequence[int]], eos: Stop) -> Rollout:
    """``rollout`` generated after ``prompts`` + ``prefixes`` (in its prompt block), laid out again with each prefix at
    the head of its response: left-padded prompts, then prefix + continuation, the prefix tokens ``external`` (not in
    :attr:`Rollout.loss_tokens_B_T`). Truncation flags are the continuation's."""
    responses = [list(x) + r for x, r in zip(prefixes, response_ids(rollout))]
    out = rollout_from_responses(tok, prompts, responses, eos)
    out.truncated_B = rollout.truncated_B.clone()
    P, R = out.prompt_width, out.sequences_B_T.shape[1] - out.prompt_width
    external_B_R = torch.arange(R)[None, :] < torch.tensor([len(x) for x in prefixes])[:, None]
    out.loss_tokens_B_T = out.response_mask_B_T.clone()
    out.loss_tokens_B_T[:, P:][external_B_R] = 0
    return out


def _assemble(sequences_B_T: torch.Tensor, prompt_mask_B_P: torch.Tensor, resp_B_R: torch.Tensor, eos: Stop) -> Rollout:
    """A :class:`Rollout` from the full sequences, the (left-padded) prompt block's mask and the response mask; a row
    is truncated when no EOS (any id of ``eos``) lies inside its response mask."""
    P = prompt_mask_B_P.shape[1]
    truncated_B = ~(is_eos(sequences_B_T[:, P:], eos) & resp_B_R.bool()).any(-1)
    return Rollout(
        sequences_B_T,
        torch.cat([prompt_mask_B_P, resp_B_R], dim=1),
        torch.cat([torch.zeros_like(prompt_mask_B_P), resp_B_R], dim=1),
        truncated_B,
        P,
    )


def _keep_external(out: Rollout, before: Rollout) -> Rollout:
    """``out`` (``before`` with a shorter response mask) keeping ``before``'s external tokens out of its loss."""
    if before.loss_tokens_B_T is not None:
        out.loss_tokens_B_T = before.loss_tokens_B_T * out.response_mask_B_T
    return out


def cap_responses(rollout: Rollout, caps_B: list[int], eos: Stop) -> Rollout:
    """Cut each row's response at its own cap (per-route ``max_new_tokens`` in one mixed batch generated to the
    largest cap): tokens past the cap leave both masks, and a row without EOS (any id of ``eos``, as the rollout was
    generated with: :func:`eos_ids`) inside its cap counts as truncated."""
    R = rollout.sequences_B_T.shape[1] - rollout.prompt_width
    if all(c >= R for c in caps_B):
        return rollout
    P = rollout.prompt_width
    keep_B_R = (torch.arange(R)[None, :] < torch.tensor(caps_B)[:, None]).long()
    resp_B_R = rollout.response_mask_B_T[:, P:] * keep_B_R
    out = _keep_external(_assemble(rollout.sequences_B_T, rollout.attention_mask_B_T[:, :P], resp_B_R, eos), rollout)
    # A row that had ended inside its cap (at EOS, or at a stop string: :func:`cut_at_stops`) stays ended.
    out.truncated_B &= ~(~rollout.truncated_B & (rollout.response_lengths_B <= torch.tensor(caps_B)))
    return out


def rollout_from_responses(tok: PreTrainedTokenizerBase, prompts: list[str], responses: list[list[int]],
                           eos: Stop | None = None) -> Rollout:
    """A :class:`Rollout` over given response token ids (off-policy data: teacher samples or a dataset column), in
    the same layout as :func:`generate`: left-padded prompts, then responses right-padded with the pad token. A
    response is ended (not truncated) when it holds one of the stop ids ``eos`` (default the tokenizer's EOS)."""
    enc = tok(prompts, return_tensors="pt", padding=True, padding_side="left", add_special_tokens=False)
    R = max(1, max(map(len, responses)))
    gen_B_R = torch.full((len(responses), R), tok.pad_token_id, dtype=torch.long)
    for i, ids in enumerate(responses):
        gen_B_R[i, : len(ids)] = torch.tensor(ids, dtype=torch.long)
    lens_B = torch.tensor([len(ids) for ids in responses])
    resp_B_R = (torch.arange(R)[None, :] < lens_B[:, None]).long()
    return _assemble(torch.cat([enc.input_ids, gen_B_R], dim=1), enc.attention_mask, resp_B_R,
                     eos_ids(tok) if eos is None else eos)


def response_ids(rollout: Rollout) -> list[list[int]]:
    """Each row's response token ids up to and including its first EOS (the inverse of :func:`rollout_from_responses`)."""
    return [seq_T[m_T.bool()].tolist() for seq_T, m_T in zip(rollout.sequences_B_T, rollout.response_mask_B_T)]


def decode_responses(tok: PreTrainedTokenizerBase, rollout: Rollout,
                     stop: Sequence[Sequence[str]] | None = None) -> list[str]:
    """Response text up to (not including) the first EOS, and before its row's first stop string (``stop``: each
    row's, as the rollout was generated with)."""
    texts = [tok.decode(ids, skip_special_tokens=True) for ids in response_ids(rollout)]
    return texts if stop is None else [strip_stop(t, x) for t, x in zip(texts, stop)]


def forward_hidden(model: PreTrainedModel, sequences_B_T: torch.Tensor, attention_mask_B_T: torch.Tensor) -> torch.Tensor:
    """Final hidden states ``[B, T, H]`` of a causal LM's decoder (no logits: the head is applied chunk by chunk), on
    the model's device, computed under its compute dtype's autocast (the inputs may live on the CPU)."""
    device = model_device(model)
    attention_mask_B_T = attention_mask_B_T.to(device)
    with autocast_for(model):
        out = model.get_decoder()(
            input_ids=sequences_B_T.to(device),
            attention_mask=attention_mask_B_T,
            position_ids=position_ids_from_mask(attention_mask_B_T),
            use_cache=False,
        )
    return out.last_hidden_state


@torch.no_grad()
def token_logprobs(
    model: PreTrainedModel, rollout: Rollout, temperatures: tuple[float, ...], chunk_size: int = 64,
    vocab_size: int | None = None,
) -> list[torch.Tensor]:
    """Log-probs of each next token under ``model`` at each temperature: ``[B, T-1]`` tensors aligned with the hidden
    positions ``0..T-2`` (position t scores token t+1), over the ids ``[0, vocab_size)`` (the tokenizer's, as
    :func:`generate` samples them; None: the head's whole width). The head runs chunk by chunk, so no ``[B, T, V]``
    exists; the log-softmax is fp32 whatever the model's dtype, and the log-probs come back on the CPU."""
    hidden_B_T_H = forward_hidden(model, rollout.sequences_B_T, rollout.attention_mask_B_T)[:, :-1]
    targets_B_T = rollout.sequences_B_T[:, 1:].to(hidden_B_T_H.device)
    head = model.get_output_embeddings()
    outs: list[list[torch.Tensor]] = [[] for _ in temperatures]
    for start in range(0, hidden_B_T_H.shape[1], chunk_size):
        with autocast_for(model):
            z_B_C_V = head(hidden_B_T_H[:, start:start + chunk_size])[..., :vocab_size].float()
        tgt_B_C_1 = targets_B_T[:, start:start + chunk_size, None]
        for out, temp in zip(outs, temperatures):
            out.append(torch.log_softmax(z_B_C_V / temp, dim=-1).gather(-1, tgt_B_C_1).squeeze(-1))
    return [torch.cat(o, dim=1).cpu() for o in outs]
