"""Everything of ttt that extends or overrides hivemind 1.1.12: the only room that touches hivemind's internals.

    member.py        this peer's part in the swarm (`SwarmMember`, `DiLoCoMember`): what the rest of ttt asks of
                     hivemind's optimizer, in ttt's words
    wiring.py        a peer's part in the swarm, built from the run's settings (`join_swarm`): synchronous or DiLoCo
    optimizer.py     hivemind.Optimizer as `SwarmOptimizer`: round sizes, downloads, lineage, holds for newcomers
    diloco.py        DiLoCo's outer rounds on hivemind's averagers
    keeper.py        a public helper's `KeeperOptimizer`: in every round without samples, it keeps and serves the state
    joins.py         the holds newcomers ask for, read from the run's records (the join protocol)
    matchmaking.py   hivemind's matchmaking, paced: a peer reads a group's leaders at most four times a second;
                     a round given up stops its search at once
    aggregation.py   robust reduction, pure math (poisoned pieces dropped; the mean or CenteredClip)
    allreduce.py     hivemind's all-reduce round, reducing with aggregation.py; the same bits for every member
    shares.py        each reducer's share of a round, by the bandwidth it declared (capped)
    received.py      a reducer's sums of what each sender sent it, by region of the audits' sketch (pure torch)
    admission.py     averagers that answer only the admitted peers of an authenticated run
    authorizer.py    hivemind's token protocol on DHT requests, and the peer's key as hivemind's process-wide key
    compression.py   averaging compression: gradients and states in 8-bit blocks (the paper's codec lost a tenth
                     and more of each gradient), 1- and 4-bit pseudo-gradients
    dht.py           joining the run's DHT: as a full peer or a client, as the reachability check decided; pings
    reachability.py  whether others can connect to this machine: the dial-back check, asked and served
    processes.py     hivemind's child processes and its logging

peer/, monitor/ and calc/ do not import hivemind: they hold a `SwarmMember` and hivemind's DHT (its public methods).
What is overridden or reached into, each with the hivemind line it relies on and why: docs/design/hivemind-overrides.md,
the authoritative list (tests/test_layout.py checks it against the code).
"""
