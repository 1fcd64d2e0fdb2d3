"""MRAG retrieval: CLIP embeddings (open_clip), FAISS indexes, dynamic-library refresh."""
