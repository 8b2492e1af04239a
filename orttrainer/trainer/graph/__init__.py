"""Graph passes: each a small function ModelProto -> ModelProto (or an append onto a GraphEditor), tested alone, under
one contract (`passes.py`): a name, the rule in its docstring, a precondition that raises `PassPreconditionError`,
copy-or-mutate declared; `passes.run_passes` applies a list of them, saves stages and verifies the results."""
