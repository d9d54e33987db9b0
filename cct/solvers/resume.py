"""Exact resume: what a snapshot must hold, besides Caffe's fields, for ``-snapshot`` to go on bit for bit.

Caffe's solverstate has the iteration, the learning-rate step and the update history; the weights are in
the caffemodel.  A run resumed from those alone restarts every data source at its first record and every
random stream from a new seed, so it drifts away from the run it continues (Caffe 1.0 behaves so).  cct also
writes, in ``SolverState.cct_resume_state`` (field 1001, which Caffe skips) or the root attribute
``cct_resume_state`` of a ``.solverstate.h5`` (which Caffe ignores), one JSON document::

    {"format": 1,
     "train": [{"layers": {layer name: layer.resume_state()}, "rng": <the global stream>} for each rank],
     "test": [{layer name: layer.resume_state()} for each test net]}

The layers' states are data cursors and their private streams (transformer mirror/crop, list shuffling),
taken *after the last batch the net consumed* (see :mod:`cct.data.prefetch`); the global stream draws the
fillers, Dropout masks and stochastic pooling.  Under data parallelism the root writes every rank's state —
thread replicas' directly, MPI ranks' gathered at the snapshot (``Solver.state_gather``) — and each rank
restores its own.  A state without the field (made by Caffe, or before cct wrote it) restores as Caffe does,
which is logged once.
"""
from __future__ import annotations

import json
from typing import Any

from cct import log
from cct.errors import CctError
from cct.rng import restore_stream, stream_state

FORMAT = 1


def net_state(net: Any) -> dict[str, Any]:
    """``{layer name: state}`` of the layers of ``net`` that keep one."""
    states = {}
    for layer in net.layers:
        state = layer.resume_state()
        if state is not None:
            states[layer.name] = state
    return states


def restore_net_state(net: Any, states: dict[str, Any], source: str, what: str) -> None:
    by_name = {layer.name: layer for layer in net.layers}
    for name, state in states.items():
        layer = by_name.get(name)
        if layer is None:
            log.warning("%s: the %s has no layer '%s' any more; its saved data cursor is not used", source, what, name)
            continue
        layer.restore_resume_state(state)


def rank_state(solver: Any) -> dict[str, Any]:
    """This rank's part of the document: its train net's layer states and the global stream."""
    return {"layers": net_state(solver.net), "rng": stream_state()}


def capture(solver: Any, gather: bool = True) -> bytes:
    """The resume document of ``solver`` (the root: it writes every rank's train-net state; with ``gather``
    False, an MPI root writes its own only)."""
    if getattr(solver, "state_gather", None) is not None and gather:
        train = [json.loads(b) for b in solver.state_gather(json.dumps(rank_state(solver)).encode("utf-8"))]
    else:
        train = [rank_state(s) for s in (getattr(solver, "replicas", None) or [solver])]
    doc = {"format": FORMAT, "train": train, "test": [net_state(n) for n in solver.test_nets]}
    return json.dumps(doc, separators=(",", ":")).encode("utf-8")


def share(solver: Any) -> None:
    """A non-root MPI rank's part in a snapshot: hand its state to the gather."""
    solver.state_gather(json.dumps(rank_state(solver)).encode("utf-8"))


def read_resume_state(path: str) -> bytes:
    """The cct field of a ``.solverstate`` or ``.solverstate.h5`` (empty if it has none)."""
    if path.endswith(".h5"):
        from cct.io.hdf5 import read_hdf5_solverstate

        return read_hdf5_solverstate(path).cct_resume_state
    from cct.io.weights import read_solverstate

    return read_solverstate(path).cct_resume_state


def restore(solver: Any, data: bytes, source: str) -> None:
    """Put ``solver``'s data sources and random streams back to the snapshot's (see the module docstring)."""
    if not data:
        if solver.rank == 0:  # once per resume, by the root
            log.info("%s has no cct resume state (a Caffe solverstate): data sources restart from their first "
                     "record and random streams are not restored, as in Caffe", source)
        return
    try:
        doc = json.loads(data.decode("utf-8"))
        if not isinstance(doc, dict) or doc.get("format") != FORMAT:
            raise ValueError(f"unknown format {doc.get('format') if isinstance(doc, dict) else doc!r}")
        rank, count = solver.rank, solver.solver_count
        train = doc["train"]
        if not train:
            raise ValueError("no train net state")
        if len(train) != count:
            # another solver count: sharded cursors count records of the whole stream, so the furthest one
            # (the last rank's) is where the combined batches of the writer had got to
            if rank == 0:
                log.warning("%s was written by %d solver(s) and is resumed by %d: every rank goes on from the "
                            "last rank's data cursor", source, len(train), count)
            states = train[-1]
        else:
            states = train[rank]
        restore_net_state(solver.net, states["layers"], source, "train net")
        for net, test_states in zip(solver.test_nets, doc["test"]):
            restore_net_state(net, test_states, source, "test net")
        restore_stream(states["rng"])
    except CctError as e:
        raise CctError(f"{source}: cct_resume_state: {e}") from None
    except (ValueError, KeyError, TypeError, AttributeError, UnicodeDecodeError) as e:
        raise CctError(f"{source}: cct_resume_state is damaged ({type(e).__name__}: {e})") from None
