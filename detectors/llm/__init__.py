"""The LLM: loading and preparing it (:mod:`.loading`), its fingerprint (:mod:`.fingerprint`), layer
numbering and hooks (:mod:`.layers`), key/value-prefix reuse and batched forward passes (:mod:`.kv`), the next-token
distribution's statistics (:mod:`.distribution`), the LLM as a yes/no judge (:mod:`.judge`)."""
