"""`ttt preprocess`: the organiser's pipeline, one module per stage, in the order rows flow through it.

    metadata -> core.filters -> download -> encode -> writer (+ manifest) -> card (+ report) -> publish
    (img2dataset_output replaces metadata + download for --from-images)

`graph` runs a shard's download -> encode -> serialize chain as Dask tasks; `run` drives the whole run;
`options` holds its settings. Only the CLI, the demo, bench/ and the tests import from here.
"""
