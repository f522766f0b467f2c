"""The TPU path: the plain-PyTorch mega_depth model (mega_depth/model/decoder.py, the one the Hugging Face export uses)
trained with torch-xla SPMD. Megatron-core does not run on XLA.

Nothing here imports torch-xla at module level: `python -m mega_depth.xla.train` imports it when it starts on an
XLA device, and says how to install it when it is missing. `--device cpu` runs the same trainer eagerly (the
reference the XLA runs are checked against; it needs no torch-xla).
"""
