"""Tensor parallelism in the Megatron style (lesson 05).

mappings.py  the communication as autograd functions: f and g (each one's backward the other's
             forward) and their sequence-parallel kin (scatter, gather, reduce-scatter along T)
layers.py    column- and row-parallel linear, the fused sequence-parallel linear, the
             vocabulary-parallel cross-entropy
blocks.py    what builds on them: the vocabulary-parallel embedding, the parallel MLP,
             self-attention and transformer block (twins of minidist/transformer.py's)
parallelize.py  apply_tp: a plain transformer's layers cut over tp (the main job's step 1)
bench.py     `minidist bench tp`
"""
