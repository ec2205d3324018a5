"""The VQGAN: images <-> codes (`codec`), a small one trained for a small domain (`train`), and grids of
decoded images (`grid`). The embedded sample's trained VQGAN ships in `assets/sample_vqgan/`."""
