"""`mpic bench load` (CLI process): a bounded loopback load run against the HTTP API.

- `bench`: the command and the run (closed loop, open loop, bursts, abandoned requests);
- `requests`: one request and how its answer is classified;
- `report`: what a run measured (`LoadResult`) and its tables, JSON and PNG;
- `replica_rss`: the Serve replicas' RSS over the run.

The serving configs it is run with sit beside them: `fake.yaml`, `reference_tiny.yaml`,
`vllm.yaml` (`--config benchmarks/load/fake.yaml`).
"""
