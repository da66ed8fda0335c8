"""Hugging Face Hub access: `hf:ORG/NAME[@REV]` sources, verified downloads through huggingface_hub
(its cache, token, endpoint and xet settings), and tensor-level fetches by HTTP range requests on remote
safetensors files.

    spec.parse_spec("hf:Qwen/Qwen3.5-397B-A17B@main")             -> HubSpec
    resolve.resolve_checkpoint("hf:...", tensors=None)              -> local directory (full snapshot)
    resolve.fetch_tensor_subset("hf:...", ["model.layers.0...."])   -> local checkpoint with just those
    download.download_files(...)                                     -> files verified against the Hub sha256
    tensor_fetch.fetch_tensors(...)                                  -> range-fetched tensors + index

huggingface_hub is imported inside the functions, so `qtool --help` stays cheap.
"""
