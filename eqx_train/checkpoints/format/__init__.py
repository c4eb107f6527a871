"""What checkpoint bytes mean: the safetensors codec (`_format` writes, `_reader` reads), the
tree description, names, checksums, and the layouts (`_layouts`: one `Reader` protocol, one
opener per layout). Imports only `storage` and `checkpoints._errors`."""
