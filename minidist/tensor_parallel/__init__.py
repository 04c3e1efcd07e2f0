"""Tensor parallelism in the Megatron style (lesson 05).

layers.py  the regions f and g and their sequence-parallel kin; column- and row-parallel linear;
           the vocabulary-parallel cross-entropy
blocks.py  what builds on them: the parallel MLP, self-attention, transformer block, embedding
bench.py   `minidist bench tp`
"""
