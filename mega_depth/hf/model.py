"""In the package, the modeling file's `from .model import` resolves here; an exported folder gets the real
mega_depth/model.py (and mixing.py) copied in its place by tools/convert_to_hf.py."""

from mega_depth.model import Decoder, DecoderConfig  # noqa: F401
