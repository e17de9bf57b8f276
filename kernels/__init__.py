# Ships the CUDA sources inside the wheel as the package `cunorm.kernels`
# (pyproject.toml maps this folder there); cunorm/source.py reads them.
