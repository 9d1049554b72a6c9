"""Data shipped with the engine: ``corpus.txt``, the text the test tokenizer is trained on.

A package only so that installs carry ``corpus.txt`` (package data); see ``make_corpus.py``.
"""
