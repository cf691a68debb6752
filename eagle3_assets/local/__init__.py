"""The embedded, download-free stand-ins for a real deployment, and what runs them: the tiny verifier and the real one
(SmolLM2 from its wheel), the local vLLM server (``vllm_server``) and its extraction-mode twin (``extraction_server``,
with its hidden-states connector in ``vllm_plugins/``), which vLLM build an interpreter holds (``accelerator``), and
the CUDA install locks (``cuda_locks``).
"""
