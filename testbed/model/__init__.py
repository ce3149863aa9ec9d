"""The model's closed forms: its shape (``transformer_shape``), parameters and FLOPs
(``model_card``, ``megatron_flops``), the whole model's memory and time terms
(``whole_model``, ``fp8_casts``, ``recompute_modules``), its MTP layers
(``mtp_layers``) and published figures in Megatron's unit (``published_conversion``).
Pure arithmetic on the scenario's numbers: the policies above and both backends use them."""
