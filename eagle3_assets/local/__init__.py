"""Local, download-free stand-ins for the real deployment: a tiny verifier model and a CPU vLLM server."""
