"""The offline feature cache: shard format, manifest, writer, reader pipeline."""
