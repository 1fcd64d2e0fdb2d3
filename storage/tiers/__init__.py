"""The entry store's tiers, fastest first: the tier interface (`tier`), decoded entries in memory
(`memory`), blobs on local disk (`disk`) and the durable object-store copy (`object`)."""
