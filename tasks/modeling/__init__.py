"""Models: checkpoints (models), generation and log-probs (rollout), vLLM engines (engines), the teacher interface and
its kinds (teacher), lazily loaded teachers (teacher_pool) and what the merge reads of registered teachers
(routing). Above common."""
