"""Object-store backends (filesystem, S3 via minio), the cache-entry codec, the tiered entry
store, the static/dynamic library catalogs and the parallel fetch with fallback. Imports no vLLM."""
