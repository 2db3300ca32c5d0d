"""The systems the peers benchmark runs beside kvserve: llama.cpp's server built from source, transformers' generate."""
