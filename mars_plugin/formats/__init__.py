"""File formats every command and adapter shares: label PNGs (0..C, 254 biased, 255 ignore),
images, feature files (.npy/.pt), atomic writes (``files.py``)."""
