"""The only package that touches megatron-core internals. Importing it stays cheap."""
