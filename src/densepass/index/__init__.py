"""Encoding, exact and FAISS dense search, and BM25."""
