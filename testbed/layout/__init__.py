"""Parallel layouts as Megatron-Core and DeepSeek run them (issue 25): process groups with
and without MoE parallel folding, the batch in sequences, pipeline layout strings and
schedules, recompute by module. Pure closed forms and orders over the scenario's numbers;
the scenario (``testbed.scenario``), the policies and both backends build on them; it
imports only ``testbed.core``."""
