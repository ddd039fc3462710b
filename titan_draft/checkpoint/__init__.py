"""Distributed checkpoints: DCP save/load, integrity records, the resume guard, the draft export."""
