from offsetlake.cli import entrypoint

entrypoint()
