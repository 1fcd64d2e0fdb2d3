"""What the serving path reports (Ingress and LLM-worker Serve replicas): the `mpic_*` metrics and
their vLLM-named twins, and the live fidelity guarantee (sampled shadow exact prefills and the
budget loop they drive)."""
