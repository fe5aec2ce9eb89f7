"""The front end and the engine core in two processes: the front end's side
(:mod:`.core_client`: the child process started, or a core attached to), the
core's process (:mod:`.core_process`, ``python -m
asyncstep.engine.transport.core_process``) and its side of its front ends
(:mod:`.front_ends`). msgpack frames over socket pairs.

May import, of the engine, :mod:`asyncstep.engine.executor`,
:mod:`asyncstep.engine.core` and :mod:`asyncstep.engine.messages`; never the
front end.
"""
