"""Training recipes shared by the compressor systems (the loop itself is ``recomp_jax.train``)."""
