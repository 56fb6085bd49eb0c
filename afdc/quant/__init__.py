"""Quantized weight formats as checkpoints ship them: their definitions and how they are recognised."""
