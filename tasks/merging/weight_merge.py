"""Weight-merging baselines: the cheapest alternative to an OPD merge, for specialists fine-tuned from one shared base.

Every method works on task vectors, the specialists' weight deltas from the base, tensor by tensor:

    tau_i = theta_i - theta_0                       (expert i's task vector; theta_0 is the base)
    theta = theta_0 + lambda * combine(tau_1, ..., tau_E)

``task_arithmetic`` sums the task vectors, ``ties`` trims, elects a sign and averages the survivors, ``dare`` drops
entries at random and rescales before summing. Each is a pure function over state dicts (``dict[str, Tensor]``) and
names the `mergekit <https://github.com/arcee-ai/mergekit>`_ method it corresponds to (with every expert's mergekit
``weight: 1.0`` and ``lambda`` = our ``scale``). These are for full-weight specialists, where peft has nothing to
offer; LoRA specialists are merged by peft's own ``add_weighted_adapter`` (:func:`merge_adapters`).
``merge_checkpoints`` runs one on checkpoints (picking peft when every expert carries its adapter) and saves a normal
Hugging Face checkpoint::

    from tasks.merging.weight_merge import merge_checkpoints
    merge_checkpoints(base_dir, [spec_a_dir, spec_b_dir], "ties", "out/ties-merge", density=0.5)

Floating-point tensors are merged in float32 (or the base's dtype when wider) and cast back to the base's dtype;
integer and boolean tensors and the model's buffers are copied from the base. Sparsification is per expert and per
tensor, so peak extra memory is one tensor per expert on top of the loaded state dicts.
"""

from __future__ import annotations

import hashlib
import json
from collections.abc import Callable, Sequence
from pathlib import Path

import torch

from tasks.common.adapters import saved_adapter

StateDict = dict[str, torch.Tensor]

METHODS = ("task_arithmetic", "ties", "dare")
MERGEKIT_METHOD = {"task_arithmetic": "task_arithmetic", "ties": "ties", "dare": "dare_linear"}
# LoRA specialists (their peft adapters in <checkpoint>/adapter) are merged by peft's own add_weighted_adapter:
# ``cat`` stacks the adapters, so its delta is exactly the weighted sum of theirs (task arithmetic); ``ties`` and
# ``dare_linear`` are peft's TIES and DARE on the adapters' A and B matrices.
PEFT_COMBINATION = {"task_arithmetic": "cat", "ties": "ties", "dare": "dare_linear"}


def check_compatible(base: StateDict, experts: Sequence[StateDict], labels: Sequence[str] | None = None) -> None:
    """Raise ValueError naming the first tensor an expert lacks, adds, or holds with another shape than the base."""
    if not experts:
        raise ValueError("no experts to merge: pass at least one expert state dict")
    labels = list(labels) if labels is not None else [f"#{i}" for i in range(len(experts))]
    for label, expert in zip(labels, experts):
        for name, base_t in base.items():
            if name not in expert:
                raise ValueError(f"expert {label} does not match the base: it has no tensor {name!r}")
            if tuple(expert[name].shape) != tuple(base_t.shape):
                raise ValueError(
                    f"expert {label} does not match the base: {name!r} has shape {tuple(expert[name].shape)}, "
                    f"the base {tuple(base_t.shape)}"
                )
        extra = [name for name in expert if name not in base]
        if extra:
            raise ValueError(f"expert {label} does not match the base: it has a tensor {extra[0]!r} the base lacks")


def task_vectors(base: StateDict, experts: Sequence[StateDict]) -> list[StateDict]:
    """tau_i = theta_i - theta_0 for every floating-point tensor (computed in at least float32); one dict per expert."""
    check_compatible(base, experts)
    return [
        {name: _delta_E_N(base_t, [expert], name)[0].reshape(base_t.shape) for name, base_t in base.items()
         if torch.is_floating_point(base_t)}
        for expert in experts
    ]


def task_arithmetic(base: StateDict, experts: Sequence[StateDict], scale: float = 1.0) -> StateDict:
    """Task arithmetic (Ilharco et al. 2023), mergekit ``task_arithmetic``:

        theta = theta_0 + lambda * sum_i tau_i          (lambda = ``scale``)

    One expert at ``scale`` 1 gives back that expert; ``scale`` 1/E gives the plain average of the experts."""
    return _merge(base, experts, lambda name, delta_E_N: scale * delta_E_N.sum(0))


def ties(base: StateDict, experts: Sequence[StateDict], density: float = 0.5, scale: float = 1.0) -> StateDict:
    """TIES-merging (Yadav et al. 2023), mergekit ``ties`` (its default ``normalize: true``). Per tensor of N entries:

        trim:   tau^_i = tau_i * m_i, m_i keeps the k = max(1, floor(density * N)) entries of largest |tau_i|
        elect:  gamma = sign(sum_i tau^_i), with a zero sum electing +1
        merge:  tau_m = sum_{i in A} tau^_i / max(|A|, 1),  A = {i : sign(tau^_i) = gamma} (per entry; trimmed
                and zero entries have sign 0 and never count)
                theta = theta_0 + lambda * tau_m         (lambda = ``scale``)

    With ``density`` 1 and experts that agree in sign everywhere this is theta_0 + lambda * mean_i tau_i."""
    _check_density(density)

    def merge(name: str, delta_E_N: torch.Tensor) -> torch.Tensor:
        k = max(1, int(density * delta_E_N.shape[1]))
        top_E_K = delta_E_N.abs().topk(k, dim=1).indices
        keep_E_N = torch.zeros_like(delta_E_N, dtype=torch.bool).scatter_(1, top_E_K, True)
        trimmed_E_N = delta_E_N * keep_E_N
        gamma_N = torch.where(trimmed_E_N.sum(0) >= 0, 1.0, -1.0).to(delta_E_N.dtype)
        agree_E_N = trimmed_E_N.sign() == gamma_N
        count_N = agree_E_N.sum(0).clamp(min=1)
        return scale * (trimmed_E_N * agree_E_N).sum(0) / count_N

    return _merge(base, experts, merge)


def dare(
    base: StateDict, experts: Sequence[StateDict], density: float = 0.5, scale: float = 1.0, seed: int = 0
) -> StateDict:
    """DARE, drop and rescale (Yu et al. 2024), then task arithmetic; mergekit ``dare_linear``:

        m_i ~ Bernoulli(p) per entry,  tau~_i = m_i * tau_i / p        (p = ``density``)
        theta = theta_0 + lambda * sum_i tau~_i                        (lambda = ``scale``)

    E[tau~_i] = tau_i, so the expected merge is ``task_arithmetic``; ``density`` 1 is exactly it. The masks depend
    only on (``seed``, expert index, tensor name), not on dict order. One difference from mergekit 0.1.5: its
    ``rescale: true`` rescales each kept tensor to the original's L1 norm, sum|tau_i| / sum|m_i * tau_i|, where this
    uses the paper's 1/p (equal in expectation; equal exactly at ``density`` 1). mergekit draws from torch's global
    RNG, so its masks are not reproducible from a seed."""
    _check_density(density)

    def merge(name: str, delta_E_N: torch.Tensor) -> torch.Tensor:
        keep_E_N = torch.stack([
            torch.rand(delta_E_N.shape[1], generator=_generator(seed, i, name)) < density
            for i in range(delta_E_N.shape[0])
        ]).to(delta_E_N.device)
        return scale * (delta_E_N * keep_E_N).sum(0) / density

    return _merge(base, experts, merge)


def merge_checkpoints(
    base_uri: str | Path,
    expert_uris: Sequence[str | Path],
    method: str,
    out_dir: str | Path,
    density: float = 0.5,
    scale: float = 1.0,
    seed: int = 0,
) -> str:
    """Merge expert checkpoints fine-tuned from ``base_uri`` with ``method`` (one of :data:`METHODS`), save the result
    as a Hugging Face checkpoint (safetensors, the base's config and tokenizer, plus ``weight_merge.json`` recording
    how it was made) in ``out_dir`` and return its path. ``density`` is used by ``ties`` and ``dare``, ``seed`` by
    ``dare``. Raises ValueError naming the first expert whose architecture, tokenizer, tensor names or shapes differ
    from the base's. All models are loaded in float32 with :func:`tasks.modeling.models.load_model`."""
    from tasks.modeling.models import load_model, save_model
    from tasks.specs.tokenizer import compatibility_problems, load_tokenizer

    # Experts that are LoRA fine-tunes (each with its peft adapter in <checkpoint>/adapter) go to peft's own
    # adapter merging (merge_adapters); full-weight experts to the task-vector functions above.
    if method not in METHODS:
        raise ValueError(f"method {method!r} is not one of {list(METHODS)}")
    if not expert_uris:
        raise ValueError("no experts to merge: pass at least one expert checkpoint")
    if method != "task_arithmetic":
        _check_density(density)
    adapters = [saved_adapter(u) for u in expert_uris]
    if all(adapters):
        return merge_adapters(base_uri, adapters, method, out_dir, density, scale, seed)
    tok = load_tokenizer(base_uri)
    base_model = load_model(base_uri)
    arch = (base_model.config.model_type, list(base_model.config.architectures or []))
    expert_sds = []
    for uri in expert_uris:
        expert = load_model(uri)
        expert_arch = (expert.config.model_type, list(expert.config.architectures or []))
        if expert_arch != arch:
            raise ValueError(f"expert {uri} has architecture {expert_arch}, the base {base_uri} has {arch}")
        problems = compatibility_problems(tok, load_tokenizer(uri))
        if problems:
            raise ValueError(f"expert {uri} has another tokenizer than the base {base_uri}: {'; '.join(problems)}")
        expert_sds.append(expert.state_dict())
        del expert
    base_sd = base_model.state_dict()
    check_compatible(base_sd, expert_sds, [str(u) for u in expert_uris])

    # Only parameters are merged; buffers (and anything else in the state dict) stay the base's.
    param_names = {name for name, _ in base_model.named_parameters(remove_duplicate=False)}
    params = {name: t for name, t in base_sd.items() if name in param_names}
    expert_params = [{name: sd[name] for name in params} for sd in expert_sds]
    if method == "task_arithmetic":
        merged = task_arithmetic(params, expert_params, scale)
    elif method == "ties":
        merged = ties(params, expert_params, density, scale)
    else:
        merged = dare(params, expert_params, density, scale, seed)
    base_model.load_state_dict({**base_sd, **merged})

    out = save_model(base_model, tok, out_dir)
    record = {
        "method": method,
        "mergekit_method": MERGEKIT_METHOD[method],
        "base_uri": str(base_uri),
        "expert_uris": [str(u) for u in expert_uris],
        "density": density if method != "task_arithmetic" else None,
        "scale": scale,
        "seed": seed if method == "dare" else None,
    }
    (out / "weight_merge.json").write_text(json.dumps(record, indent=2) + "\n")
    return str(out)


def merge_adapters(base_uri: str | Path, adapter_dirs: Sequence[str | Path], method: str, out_dir: str | Path,
                   density: float = 0.5, scale: float = 1.0, seed: int = 0) -> str:
    """Merge LoRA adapters of ``base_uri`` with peft's ``add_weighted_adapter`` (:data:`PEFT_COMBINATION`: every
    adapter weighted ``scale``; ``density`` for TIES and DARE, ``seed`` for DARE's random drop), merged into the base
    and saved like :func:`merge_checkpoints`'s result. ValueError when an adapter was trained on another base."""
    from peft import PeftModel

    from tasks.common.adapters import ADAPTER_CONFIG
    from tasks.modeling.models import load_model, save_model
    from tasks.specs.tokenizer import load_tokenizer

    for folder in adapter_dirs:
        trained_on = json.loads((Path(folder) / ADAPTER_CONFIG).read_text()).get("base_model_name_or_path")
        if trained_on and Path(str(trained_on)).resolve() != Path(base_uri).resolve():
            raise ValueError(f"adapter {folder} was trained on {trained_on}, not on the base {base_uri}")
    names = [f"expert{i}" for i in range(len(adapter_dirs))]
    model = PeftModel.from_pretrained(load_model(base_uri), str(adapter_dirs[0]), adapter_name=names[0])
    for name, folder in zip(names[1:], adapter_dirs[1:]):
        model.load_adapter(str(folder), adapter_name=name)
    combination = PEFT_COMBINATION[method]
    torch.manual_seed(seed)  # peft's DARE draws its drop mask from torch's global generator
    model.add_weighted_adapter(names, [scale] * len(names), "merged", combination_type=combination,
                               **({"density": density} if method != "task_arithmetic" else {}))
    model.set_adapter("merged")
    for name in names:
        model.delete_adapter(name)
    out = save_model(model.merge_and_unload(), load_tokenizer(base_uri), out_dir)
    record = {"method": method, "peft_combination": combination, "base_uri": str(base_uri),
              "adapters": [str(a) for a in adapter_dirs], "density": density if method != "task_arithmetic" else None,
              "scale": scale, "seed": seed if method == "dare" else None}
    (out / "weight_merge.json").write_text(json.dumps(record, indent=2) + "\n")
    return str(out)


def _merge(
    base: StateDict, experts: Sequence[StateDict], merge: Callable[[str, torch.Tensor], torch.Tensor]
) -> StateDict:
    """theta = theta_0 + merge(name, tau_E_N) per floating-point tensor (flattened to N entries); others copied."""
    check_compatible(base, experts)
    out: StateDict = {}
    for name, base_t in base.items():
        if not torch.is_floating_point(base_t):
            out[name] = base_t.clone()
            continue
        delta_E_N = _delta_E_N(base_t, experts, name)
        merged_N = base_t.reshape(-1).to(delta_E_N.dtype) + merge(name, delta_E_N)
        out[name] = merged_N.reshape(base_t.shape).to(base_t.dtype)
    return out


def _delta_E_N(base_t: torch.Tensor, experts: Sequence[StateDict], name: str) -> torch.Tensor:
    work = torch.promote_types(base_t.dtype, torch.float32)
    base_N = base_t.detach().reshape(-1).to(work)
    return torch.stack([e[name].detach().reshape(-1).to(device=base_N.device, dtype=work) - base_N for e in experts])


def _generator(seed: int, expert: int, name: str) -> torch.Generator:
    digest = hashlib.sha256(f"{seed}/{expert}/{name}".encode()).digest()
    return torch.Generator().manual_seed(int.from_bytes(digest[:8], "little") & (2**63 - 1))


def _check_density(density: float) -> None:
    if not 0 < density <= 1:
        raise ValueError(f"density must be in (0, 1], got {density}")
