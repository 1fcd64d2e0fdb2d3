"""Linked KV containers (linker): the `LinkedKV` protocol (`linked`), the dense reference one
(`dense`) and several requests' linked KVs as one (`stacked`)."""
