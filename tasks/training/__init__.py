"""Training loops: SFT (sft), GRPO (rl), one distillation step (distill), the sharded student (sharded), merge
checkpoints (checkpoint) and the base and specialist Prefect tasks (pretrain, specialist). Above evaluation."""
