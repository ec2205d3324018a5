"""Everything of ttt that extends or overrides hivemind 1.1.12: the only room that touches hivemind's internals.

    aggregation.py   robust reduction, pure math (poisoned pieces dropped; the mean or CenteredClip)
    allreduce.py     hivemind's all-reduce round, reducing with aggregation.py; the same bits for every member
    admission.py     averagers that answer only the admitted peers of an authenticated run
    compression.py   the paper's averaging compression (a decoder that works under numpy >= 2.4), 1- and 4-bit
                     pseudo-gradients
    optimizer.py     hivemind.Optimizer as `SwarmOptimizer`: round sizes, downloads, lineage, holds for newcomers
    keeper.py        a public helper's `KeeperOptimizer`: in every round without samples, it keeps and serves the state
    joins.py         the holds newcomers ask for, read from the run's records
    diloco.py        DiLoCo's outer rounds on hivemind's averagers
    dht.py           joining the run's DHT: as a full peer or a client, as the reachability check decided
    reachability.py  whether others can connect to this machine: the dial-back check, asked and served
    processes.py     hivemind's child processes and its logging
    wiring.py        a peer's optimizer, built from its settings (`make_optimizer`)

The rest of training/ uses hivemind only through these modules (and hivemind's public API: DHT, get_dht_time).

What is overridden, the upstream code it mirrors (hivemind 1.1.12, site-packages/hivemind/...), and why:

allreduce.py
- `TensorPartReducer.accumulate_part` (averaging/partition.py:218), `reset_accumulators` (:202),
  `check_current_part_finished` (:257), `finalize` (:263): keep each sender's piece instead of adding it to a
  running sum, so that poisoned pieces can be dropped and CenteredClip can run once all pieces are in.
- `AllReduceRunner.__init__` (averaging/allreduce.py:63): swaps in the robust reducer.
- `AllReduceRunner._communicate_with_peer` (:201): a `same_result` reducer takes the same compressed result for its
  own part as it sends the others; the exchange with another reducer is `_send_and_receive`, which records results
  as they arrive and names what failed.
- `P2P._iterate_protobuf_stream_handler` (p2p/p2p_daemon.py:486) as `_call_reducer`: hivemind's client treats a
  stream cut off early as a normal end and then waits for its writer; a `same_result` sender holding its parts for
  the results deadlocked with it until the round's timeout. Ours ends the hold however the results end; a full
  peer waits `reducer_timeout` for each result, a client until the round's timeout (hivemind's ran while a client
  sent: a home's small-preset gradients at 20 Mbit/s outlasted it, and no result ever arrived; 4 s from the end of
  its parts still lost a 2 Mbit/s home's results, which come only once its parts are in, through buffers).
- `AllReduceRunner._generate_input_for_peer` (:247): counts bytes; with `same_result`, ends the parts only once the
  reducer's results are all in (a reset stream otherwise drops results still buffered).
- `AllReduceRunner._accumulate_parts_streaming` (:335): returns the result itself with `same_result` (hivemind
  returns the difference), serialized once for all senders; counts bytes.
- `AllReduceRunner._ban_sender` (:317): records why a sender was left out.
- `DecentralizedAverager._run_allreduce_inplace_` (averaging/averager.py:537): runs the robust runner, copies the
  result in with `same_result`, and fails a `same_result` round whose members would hold different results.
- `DecentralizedAverager.rpc_download_state` (:628): counts the bytes of states served.

admission.py
- `DecentralizedAverager.rpc_join_group` (:574), `rpc_aggregate_part` (:581), `rpc_download_state` (:628): refuse
  callers without a valid credential (hivemind authenticates only the DHT's RPCs). The refusal is yielded as an
  `RPCError` message, not raised: a raising handler's stream is closed at once (p2p/p2p_daemon.py:448), and the p2p
  daemon's reset after that close could drop the refusal on its way; a refused caller's streamed parts are read to
  their end first, and the stream stays open until the caller has read the refusal and hung up.

compression.py
- `serialization._BASE_COMPRESSION_TYPES["UNIFORM_8BIT"]` (compression/serialization.py:13): hivemind's 8-bit
  decoder calls int() on a one-element array, which numpy >= 2.4 refuses; the bytes on the wire are unchanged.
- `serialization._BASE_COMPRESSION_TYPES["QUANTILE_8BIT"]` (:17), `["BLOCKWISE_8BIT"]` (:19): DiLoCo's 4-bit and
  1-bit pseudo-gradients travel under the names of these codecs, which ttt never uses (the protobuf's enum of codecs
  cannot grow).

optimizer.py
- `Optimizer.__init__` (optim/optimizer.py): when it fails after starting its progress tracker (an optimizer factory
  that raises), the tracker and the averagers it made are shut down; the tracker's pending DHT request kept the
  process from ever exiting.
- `ProgressTracker.ready_to_update_epoch` (optim/progress_tracker.py:128), `estimated_next_update_time` (:137):
  never end a global step before the latest hold a joining peer asked for.
- `ProgressTracker._parse_swarm_progress_data` (:275): bounds each peer's claimed samples and speed; while it sees no
  other peer, it looks again within 1 s instead of a quarter of its own ETA (8 s measured), so that peers starting
  together see each other before their first global step ends.
- `DecentralizedAverager.step` (averaging/averager.py:367), `load_state_from_peers` (:668),
  `get_current_state` (:653): remember the latest state round, refuse a non-finite downloaded state, carry the
  parameters' lineage in the state.
- `GradientAverager.__init__` (optim/grad_averager.py:73), `DecentralizedAverager.load_state_from_peers` (:668) for the
  gradient averager: its buffers are neither served nor downloaded as a state (hivemind's optimizer downloaded them
  after each state and reset them at once: 2.4 s of a 6.3 s catch-up at 20 Mbit/s, tiny preset).
- `TrainingStateAverager.step_executor` (optim/state_averager.py:129): an inline executor, so that the optimizer
  steps in the training thread (a second OpenMP team made every forward and backward ~20% slower on 2 cores).
- `TrainingStateAverager.step` (:329), `schedule_step` (:316): a state round looks for its group once, for at most 3
  matchmaking times (it only corrects drift), instead of for `averaging_timeout` (a newcomer sat 78 s in one).
- `Optimizer._make_progress_tracker` (optim/optimizer.py:325), `_make_state_averager` (:283): construct ours
  (the same arguments as upstream's, plus the aggregation and the admission check).
- `Optimizer._update_global_epoch` (:438), `_average_gradients_and_load_into_optimizer` (:593): record each step's
  round size and the lineage of the parameters.
- `Optimizer._maybe_schedule_gradient_averaging` (:559), `_maybe_schedule_state_averaging` (:569): no matchmaking
  when alone (it took about a core, asking the DHT for leaders).
- `Optimizer.load_state_from_peers` (:679): times each download and records whether a state arrived, for the
  progress line (hivemind moves a peer one step behind to the swarm's step even when no peer served a state).
  A peer that trains on after it also starts looking for the next round's group before the download, and sets it
  as hivemind's `scheduled_grads` after (hivemind tags along with a round scheduled before, at weight 0): the
  group forms while the peer downloads, and a peer that asked after the download missed it and fell out of step at
  every other step.
- `Optimizer.load_state_dict` (:724), with `_update_global_epoch` and `load_state_from_peers` above: decide whether
  the state is served: a trainer serves it from its first global step on (at step 0 every peer holds the run's seed).

keeper.py
- `Optimizer._check_and_accumulate_gradients` (optim/optimizer.py:546): accumulates nothing (hivemind's accumulator
  divides by the first batch size, 0 here) and stores the keeper's progress record itself, through the tracker's
  `training_progress_key` and `_local_public_key` (hivemind's `ProgressTracker._progress_reporter`,
  optim/progress_tracker.py:195, stores none for a peer without samples: the trainers would not count it).
- `ProgressTracker.ready_to_update_epoch` (:128): the keeper's step ends when its round's group has formed, never on
  an estimate; `_parse_swarm_progress_data` (:275) also reads the trainers' step from client-mode records.
- `Optimizer.step` (:369): downloads the state first when the trainers' records are at a later step.
- `Optimizer._update_global_epoch` (:438), `load_state_from_peers` (:679): serve the state only after a round with
  others or a download; after a step alone, download at once.
  The keeper does not look for the next group before a download: it joins the trainers' groups by its own rule.

reachability.py (uses, overrides nothing)
- `P2P._client.connect` and `.disconnect` (p2p/p2p_daemon_bindings/p2pclient.py:79, :93): the checker's libp2p dial
  back to a joining peer at one given address; `P2P` has no public connect.
- `DHTNode.p2p` (dht/node.py:192), reached through `DHT.run_coroutine`: the dial-back check's stream handler is served
  by the DHT's own p2pd. `hivemind.DHT(no_listen=True)` reaches `P2P.create` through `DHTNode.create`'s kwargs: a
  client listens nowhere and announces no address.

diloco.py
- `TrainingStateAverager.get_current_state` (optim/state_averager.py:627) and `load_state_from_peers`: the state a
  newcomer downloads carries the inner optimizer's state after hivemind's (the outer one's).
- `Optimizer.step`, `zero_grad`, `state_dict`, `load_state_dict`, `load_state_from_peers`, `shutdown`: hivemind's
  optimizer is DiLoCo's outer one; `step()` is one inner step.
"""
