"""A teacher from another model family: it reads the student's response as *text*, in its own tokenizer and chat
template, and hands back a signal on the student's tokens (:mod:`tasks.modeling.alignment` says how the two
tokenizations are matched). The update path stays the one every teacher uses: a :class:`TeacherScore` whose head
gives log-prob logits over the student's vocabulary, and a mask of the positions that got a signal.

Per student response token the score holds one of:

- ``FULL`` (the text before the token ends on one of the teacher's token boundaries, and the objective reads
  distributions): the teacher's hidden state at that boundary, where it predicts its next token from exactly the
  student's context; :class:`AlignedHead` turns it into the teacher's next-token distribution over
  the vocabulary both tokenizers share (mapped by token bytes; the student's stop ids onto the teacher's own
  end-of-turn token), with the teacher's remaining mass spread evenly over the student tokens it has no counterpart
  for. Full-vocabulary and top-k objectives run on these positions; others (the context cuts a teacher token, as
  after the first digit of a multi-digit teacher numeral) are masked.
- ``TOKEN`` (the objective reads the sampled token alone, ``logprobs`` 1): the teacher's log-probability of the
  student token's bytes (:mod:`tasks.modeling.alignment`: summed over the teacher tokens it spans, prefix masses where
  it cuts one), as a distribution that puts exactly that log-prob on the sampled token. Every token whose bytes the
  teacher read gets one.
- nothing (masked): a token the teacher could not read (a special token inside a response, bytes past a broken
  UTF-8 character), or, under a distribution objective, a token whose context cuts a teacher token.
"""

from __future__ import annotations

import bisect
import math
from collections.abc import Mapping, Sequence

import torch
import torch.nn.functional as F
from transformers import PreTrainedModel, PreTrainedTokenizerBase

from tasks.modeling.alignment import (SortedVocab, align, boundaries, canonical_ids, decodable, same_bytes, stop_id,
                                      token_bytes, vocab_map)
from tasks.modeling.device import model_device
from tasks.modeling.rollout import Rollout, eos_ids, forward_hidden, generate, rollout_from_responses
from tasks.objectives.losses import head_input, log1mexp
from tasks.specs.render import RowText

NONE, FULL, TOKEN = 0.0, 1.0, 2.0  # what an aligned position carries (its features' mode column)
_CHUNK = 64  # teacher positions whose full distribution exists at once


class AlignedHead(torch.nn.Module):
    """Features ``[..., H + 3]`` (the teacher's hidden state, then mode, value, target id) -> log-probs over the
    student's ``len(student_map)`` ids: at ``FULL`` positions the teacher's distribution mapped by
    ``student_map`` (student id -> teacher id, -1 none; the unmapped ids share the teacher's remaining mass evenly),
    at ``TOKEN`` positions ``value`` on the target id and the rest of the mass spread evenly elsewhere."""

    def __init__(self, teacher_head: torch.nn.Module, student_map: torch.Tensor, teacher_vocab: int, width: int,
                 folds: list[tuple[torch.Tensor, torch.Tensor]] = ()):
        super().__init__()
        self.teacher_head, self.teacher_vocab, self.width = teacher_head, teacher_vocab, width
        self.register_buffer("student_map", student_map, persistent=False)
        self.shared = student_map >= 0
        self.n_unshared = int((~self.shared).sum())
        self.folds = list(folds)  # rounds of (source ids, canonical ids): teacher ids of the same bytes, summed

    def forward(self, features_N_F: torch.Tensor) -> torch.Tensor:
        H, V = self.width, len(self.student_map)
        hidden_N_H = head_input(self.teacher_head, features_N_F[..., :H])
        mode_N, value_N = features_N_F[..., H].float(), features_N_F[..., H + 1].float()
        target_N = features_N_F[..., H + 2].round().long()
        logp_t_N_Vt = F.log_softmax(self.teacher_head(hidden_N_H)[..., :self.teacher_vocab].float(), dim=-1)
        device = logp_t_N_Vt.device
        for src, dst in self.folds:  # a text's mass is every token of it (each round: distinct canonical ids)
            src, dst = src.to(device), dst.to(device)
            logp_t_N_Vt[..., dst] = torch.logaddexp(logp_t_N_Vt[..., dst], logp_t_N_Vt[..., src])
        mode_N, value_N, target_N = mode_N.to(device), value_N.to(device), target_N.to(device)
        shared = self.shared.to(device)
        full_N_V = logp_t_N_Vt.new_full((*logp_t_N_Vt.shape[:-1], V), float("-inf"))
        full_N_V[..., shared] = logp_t_N_Vt[..., self.student_map.to(device)[shared]]
        if self.n_unshared:
            rest_N = log1mexp(full_N_V[..., shared].logsumexp(-1)) - math.log(self.n_unshared)
            full_N_V[..., ~shared] = rest_N[..., None]
        rest_N = log1mexp(value_N.clamp(max=0.0)) - math.log(max(V - 1, 1))
        token_N_V = rest_N[..., None].expand_as(full_N_V).clone()
        token_N_V.scatter_(-1, target_N.clamp(0, V - 1)[..., None], value_N[..., None])
        # Unaligned positions (masked out of the loss) still get a finite distribution: the student's would do.
        uniform = torch.full_like(full_N_V, -math.log(V))
        return torch.where((mode_N == TOKEN)[..., None], token_N_V,
                           torch.where((mode_N == FULL)[..., None], full_N_V, uniform))


def fold_rounds(groups: Mapping[bytes, tuple[int, list[int]]]) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """(canonical id, other ids) per text -> rounds of (source ids, canonical ids) in which no canonical id appears
    twice, so that each round folds with one indexed ``logaddexp``."""
    rounds: list[tuple[list[int], list[int]]] = []
    for dst, others in groups.values():
        for k, src in enumerate(others):
            if k == len(rounds):
                rounds.append(([], []))
            rounds[k][0].append(src)
            rounds[k][1].append(dst)
    return [(torch.tensor(s, dtype=torch.long), torch.tensor(d, dtype=torch.long)) for s, d in rounds]


class AlignedTeacher:
    """A teacher of another tokenizer (``teacher_tok``) over the student's (``student_tok``), on the checkpoint
    ``models[name]``: it renders each row through its own chat template (:meth:`tasks.specs.render.RowText.render`),
    reads the student's response as text, and scores it in its own tokens. ``student_eos``: the ids that end a
    student response (mapped onto the teacher's end-of-turn token)."""

    kind = "checkpoint"
    wrapper = "aligned"

    def __init__(self, name: str, models: Mapping[str, PreTrainedModel], teacher_tok: PreTrainedTokenizerBase,
                 student_tok: PreTrainedTokenizerBase, student_eos: Sequence[int] = ()):
        self.name, self.models, self.tok, self.student_tok = name, models, teacher_tok, student_tok
        self.student_eos = tuple(student_eos) or eos_ids(student_tok)
        self.student_bytes, self.teacher_bytes = token_bytes(student_tok), token_bytes(teacher_tok)
        self.same_vocab = teacher_tok.get_vocab() == student_tok.get_vocab()
        self.sorted = SortedVocab.of(self.teacher_bytes)
        self.stop = stop_id(teacher_tok)
        if self.same_vocab:  # one vocabulary: every id is itself, specials included, and no mass is folded
            self.folds, mapping = [], list(range(len(student_tok)))
            if self.student_eos and 0 <= self.student_eos[0] < len(mapping):
                mapping[self.student_eos[0]] = self.stop
        else:
            # Several teacher ids of one text: the student's token maps onto the one the teacher writes, with the
            # others' mass folded into it (a byte-fallback <0x38> beside the piece 8 would otherwise hold the digit's
            # place).
            groups = same_bytes(self.teacher_bytes)
            canonical = canonical_ids(teacher_tok, groups)
            self.folds = fold_rounds({b: (canonical[b], [i for i in ids if i != canonical[b]])
                                      for b, ids in groups.items()})
            mapping = vocab_map(self.student_bytes, self.teacher_bytes, canonical)
            for i in self.student_eos:
                if 0 <= i < len(mapping):
                    mapping[i] = self.stop if i == self.student_eos[0] else -1
        self.student_map = torch.tensor(mapping, dtype=torch.long)
        self._perm = torch.tensor(self.sorted.ids, dtype=torch.long)

    def __repr__(self) -> str:
        return f"{type(self).__name__}({self.name!r}, kind={self.kind!r})"

    @property
    def model(self) -> None:
        """None: this teacher does not read the student's tokens as they are (see :attr:`own_model`)."""
        return None

    @property
    def own_model(self) -> PreTrainedModel:
        """The checkpoint behind the teacher, in its own tokenizer."""
        return self.models[self.name]

    def own_prompt(self, text: RowText) -> str:
        """The prompt this teacher reads for a row: the row rendered through its own chat template."""
        return text.render(self.tok)

    # -- reading the student's rows ------------------------------------------------------------------------------

    def _row(self, rollout: Rollout, row: int, text: RowText):
        """One row in the teacher's terms: its prompt ids, its response ids, the alignment of each student response
        token (None: unreadable) and whether the student ended its turn."""
        P = rollout.prompt_width
        ids = rollout.sequences_B_T[row, P:][rollout.response_mask_B_T[row, P:].bool()].tolist()
        ended = bool(ids) and ids[-1] in self.student_eos
        body = ids[:-1] if ended else ids
        pieces = [(self.student_bytes[i] if i < len(self.student_bytes) else None) or b"" for i in body]
        ends = boundaries(pieces)
        # The teacher reads whole student tokens up to the first byte that is not UTF-8 text (a response cut inside
        # a character, a stray byte token): ``cut`` tokens, whose bytes decode.
        response, readable = decodable(b"".join(pieces))
        while True:
            cut = bisect.bisect_right(ends, readable)
            covered = ends[cut - 1] if cut else 0
            if covered == readable:
                break
            response, readable = decodable(b"".join(pieces)[:covered])
        prompt_ids = self.tok(self.own_prompt(text), add_special_tokens=False)["input_ids"]
        # The student's own ids where the teacher shares its vocabulary (a context teacher of the student's family):
        # every token read as sampled, not re-tokenized from the text.
        resp_ids = (body[:cut] if self.same_vocab else
                    self.tok(response, add_special_tokens=False)["input_ids"] if response else [])
        try:
            recipes = align(pieces[:cut], [self.teacher_bytes[i] or b"" for i in resp_ids])
        except ValueError:  # the teacher's tokenizer changed the text (a normaliser): nothing of the row is read
            recipes, cut = [], -1
        recipes += [None] * (len(body) - len(recipes))
        return prompt_ids, resp_ids, recipes, ended and cut == len(body)

    def score(self, batch) -> "TeacherScore":
        from tasks.modeling.teacher import TeacherScore

        if batch.texts is None:
            raise ValueError(f"teacher {self.name!r} reads its own text: the batch must carry each row's RowText")
        model, rollout, rows = self.own_model, batch.rollout, list(batch.rows)
        token_mode = batch.logprobs == 1
        parsed = [self._row(rollout, r, batch.texts[r]) for r in rows]
        seqs = [p + t + ([self.stop] if ended else []) for p, t, _, ended in parsed]
        width = max(map(len, seqs))
        pad = self.tok.pad_token_id if self.tok.pad_token_id is not None else 0
        seq_b_Tt = torch.full((len(seqs), width), pad, dtype=torch.long)
        mask_b_Tt = torch.zeros((len(seqs), width), dtype=torch.long)
        for k, s in enumerate(seqs):  # left-padded, as the student's
            seq_b_Tt[k, width - len(s):] = torch.tensor(s)
            mask_b_Tt[k, width - len(s):] = 1
        with torch.no_grad():
            hidden_b_Tt_H = forward_hidden(model, seq_b_Tt, mask_b_Tt)
        head = model.get_output_embeddings()
        H, T = hidden_b_Tt_H.shape[-1], rollout.sequences_B_T.shape[1]
        features_b_T_F = torch.zeros((len(rows), T, H + 3), dtype=torch.float32)
        signal_b_T = torch.zeros((len(rows), T), dtype=torch.long)
        P = rollout.prompt_width
        for k, (row, (prompt_ids, resp_ids, recipes, ended)) in enumerate(zip(rows, parsed)):
            start = width - len(seqs[k]) + len(prompt_ids)  # where the teacher's response begins
            targets = resp_ids + ([self.stop] if ended else [])
            h_n_H = hidden_b_Tt_H[k, start - 1:start - 1 + len(targets)]
            logp_n, mass = self._token_logps(head, h_n_H, targets, resp_ids, recipes)
            cum = [0.0]
            for v in logp_n[:len(resp_ids)]:
                cum.append(cum[-1] + v)

            def L(e) -> float:
                return cum[e.token] + (mass[(e.token, e.prefix)] if e.prefix else 0.0)

            student_ids = rollout.sequences_B_T[row, P:P + len(recipes) + int(ended)].tolist()
            for j, rec in enumerate(recipes):
                if rec is None:
                    continue
                t = P + j - 1  # the position that predicts student token j
                if token_mode:
                    features_b_T_F[k, t, H:] = torch.tensor([TOKEN, L(rec.end) - L(rec.start), student_ids[j]])
                elif not rec.start.prefix:  # the text before it ends on a teacher boundary: its distribution
                    features_b_T_F[k, t, :H] = h_n_H[rec.start.token].float().cpu()
                    features_b_T_F[k, t, H] = FULL
                else:
                    continue
                signal_b_T[k, t] = 1
            if ended:  # the student's stop token: the teacher's own end of turn
                j, t = len(recipes), P + len(recipes) - 1
                if token_mode:
                    features_b_T_F[k, t, H:] = torch.tensor([TOKEN, logp_n[-1], student_ids[j]])
                else:
                    features_b_T_F[k, t, :H] = h_n_H[-1].float().cpu()
                    features_b_T_F[k, t, H] = FULL
                signal_b_T[k, t] = 1
        teacher_head = AlignedHead(head, self.student_map, len(self.tok), H, self.folds)
        return TeacherScore(rows, features_b_T_F.to(model_device(model)), teacher_head, signal_b_T,
                            int(mask_b_Tt.sum()))

    def _token_logps(self, head, h_n_H: torch.Tensor, targets: list[int], resp_ids: list[int], recipes):
        """The teacher's log-prob of each of its ``targets`` (at the positions ``h_n_H``), and the log-masses the
        recipes' prefixes ask for: (teacher token index, prefix bytes) -> log of the mass on tokens starting with it
        at that token's position."""
        queries: dict[int, set[bytes]] = {}
        for rec in recipes:
            for e in (() if rec is None else (rec.start, rec.end)):
                if e.prefix:
                    queries.setdefault(e.token, set()).add(e.prefix)
        logp: list[float] = []
        mass: dict[tuple[int, bytes], float] = {}
        V = len(self.tok)
        for s in range(0, len(targets), _CHUNK):
            with torch.no_grad(), torch.autocast(h_n_H.device.type, enabled=False):
                z_c_V = head(head_input(head, h_n_H[s:s + _CHUNK]))[..., :V].float()
            logp_c_V = F.log_softmax(z_c_V, dim=-1)
            tgt = torch.tensor(targets[s:s + _CHUNK], device=logp_c_V.device)
            logp += logp_c_V.gather(-1, tgt[:, None]).squeeze(-1).tolist()
            asked = [i for i in range(s, min(s + _CHUNK, len(targets))) if i in queries]
            if asked:
                p_q_V = logp_c_V[[i - s for i in asked]].double().exp()[:, self._perm.to(logp_c_V.device)]
                cum_q_V = F.pad(p_q_V.cumsum(-1), (1, 0))
                for q, i in enumerate(asked):
                    for prefix in queries[i]:
                        lo, hi = self.sorted.prefix_range(prefix)
                        m = float(cum_q_V[q, hi] - cum_q_V[q, lo])
                        mass[(i, prefix)] = math.log(m) if m > 0 else -1e4
        return logp, mass

    # -- its own text ----------------------------------------------------------------------------------------------

    def _own_generate(self, rows: Sequence[RowText], cap: int, greedy: bool, temperature: float = 1.0,
                      generator: torch.Generator | None = None):
        model = self.own_model
        rollout = generate(model, self.tok, [self.own_prompt(t) for t in rows], cap, greedy=greedy,
                           temperature=temperature, generator=generator)
        stops = set(eos_ids(self.tok, model)) | {self.stop}
        texts, ended = [], []
        for ids in rollout.sequences_B_T[:, rollout.prompt_width:].tolist():
            cut = next((i for i, x in enumerate(ids) if x in stops), None)
            texts.append(self.tok.decode(ids[:cut], skip_special_tokens=True))
            ended.append(cut is not None)
        return rollout, texts, ended

    def sample(self, tok: PreTrainedTokenizerBase, rows: Sequence[RowText], caps: list[int], temperature: float,
               generator: torch.Generator | None = None) -> Rollout:
        """The teacher's own samples, in its rendering, written back in the student's tokens (``tok``) as the
        student would produce them: the text re-tokenized, the student's EOS where the teacher ended its turn."""
        _, texts, ended = self._own_generate(rows, max(caps), False, temperature, generator)
        responses = []
        for text, end, cap in zip(texts, ended, caps):
            ids = tok(text, add_special_tokens=False)["input_ids"][:cap]
            responses.append(ids + [self.student_eos[0]] if end and len(ids) < cap else ids)
        return rollout_from_responses(tok, [t.prompt for t in rows], responses, self.student_eos)

    def answer(self, rows: Sequence[RowText], max_new_tokens: int) -> tuple[list[str], list[int], list[bool]]:
        """Greedy answers in the teacher's own template and tokens: texts, lengths (teacher tokens), truncated."""
        rollout, texts, ended = self._own_generate(rows, max_new_tokens, True)
        return texts, rollout.response_lengths_B.tolist(), [not e for e in ended]


class ContextTeacher(AlignedTeacher):
    """A teacher with privileged context (self-distillation with privileged information, OPSD): it reads each row
    with the row's ``context`` column written into its user turn by ``template`` (:meth:`RowText.with_context`:
    a worked solution, a hint, retrieved facts), which the student never sees, and scores the student's response
    after it. Whatever its tokenizer (the student's own, or another family's), it reads the response as text like
    :class:`AlignedTeacher`; with the student's tokenizer every response token is read with its full distribution.
    Its held-out score and its samples are with the context too."""

    wrapper = "context"

    def __init__(self, name: str, models: Mapping[str, PreTrainedModel], teacher_tok: PreTrainedTokenizerBase,
                 student_tok: PreTrainedTokenizerBase, student_eos: Sequence[int] = (), template: str = ""):
        super().__init__(name, models, teacher_tok, student_tok, student_eos)
        self.template = template

    def own_prompt(self, text: RowText) -> str:
        return text.with_context(self.template).render(self.tok)


def own_text_teacher(record, models: Mapping[str, PreTrainedModel], student_tok: PreTrainedTokenizerBase,
                     student_eos: Sequence[int] = ()) -> AlignedTeacher:
    """The teacher object of a registered teacher that reads its own text (``record.wrapper`` aligned or context),
    on its checkpoint ``models[record.name]``, in its own tokenizer."""
    from tasks.specs.tokenizer import load_tokenizer

    tok = load_tokenizer(record.model_uri, trust_remote_code=record.trust_remote_code,
                         base=getattr(record, "base_model", "") or None)
    if record.wrapper == "context":
        return ContextTeacher(record.name, models, tok, student_tok, student_eos,
                              getattr(record, "context_template", ""))
    return AlignedTeacher(record.name, models, tok, student_tok, student_eos)
