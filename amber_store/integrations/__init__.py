"""Glue for training frameworks, each an optional extra: ``amber-store[lightning]``
(:mod:`.lightning`), ``amber-store[hf]`` (:mod:`.hf`), ``amber-store[torchtitan]``
(:mod:`.torchtitan`)."""
