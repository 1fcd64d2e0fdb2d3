"""Attention of selected queries over linked keys with a position mask, and RoPE delta rotation:
torch reference everywhere (the CPU default), Triton on GPU when available."""
