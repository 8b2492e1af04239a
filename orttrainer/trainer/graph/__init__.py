"""Graph passes: each a small function ModelProto -> ModelProto (or an append onto a GraphEditor), tested alone."""
