"""Authentication of a run: only the peers its organiser admits can join it.

    organiser: ttt auth init  -> the run's authority key pair (run.key, 0600; run.pub for everyone)
               ttt auth serve -> checks a volunteer (allowlist password, or Hugging Face organisation membership)
                                 and signs an access token bound to the volunteer's peer key
               ttt auth revoke -> a signed revocation list, served by the auth server, relayed through the DHT
    peer:      its libp2p identity is an RSA key; the token names that key, so the peer id the p2p layer
               authenticates is the token's. Every request it answers is checked:
                 DHT requests      hivemind's TokenAuthorizerBase (each request signed with the token's key)
                 averaging         join a group, send all-reduce parts, download the state: the caller's peer id
                                   must hold a valid credential (its token, published in the DHT)

keys.py     the authority's and the peers' key files, and the peer id a public key stands for
tokens.py   access tokens and revocation lists: signing, checking, with the reason a check fails
users.py    the allowlist (users.toml) with salted scrypt password hashes
server.py   `ttt auth serve`: the HTTP server that issues tokens and serves the revocation list
client.py   what a peer asks an auth server
guard.py    what runs inside a peer: the token keeper, the DHT authorizer, the averaging check, the counts
commands.py the organiser's commands (init, keygen, add-user, issue, revoke)
"""
