"""Merging specialists into one student: the OPD merge loop (merge), its state (merge_state) and weight-space baselines
(weight_merge). Above training."""
