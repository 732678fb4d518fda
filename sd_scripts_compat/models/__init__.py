"""Model families (data), building, loading (single files, diffusers folders), text encoding."""
