"""File formats every command and adapter shares: label PNGs (0..C, 254 biased, 255 ignore),
images, feature files (.npy/.pt), atomic writes (``files.py``); the one rule by which an image
of any PIL mode is read as 8-bit RGB, or refused naming its mode (``images.py``); MXNet's
``.params`` weight files, read without MXNet (``mxnet_params.py``); the one door through which
every reader takes a tensor or an array from a file, bounded before anything is allocated
(``bounded_load.py``)."""
