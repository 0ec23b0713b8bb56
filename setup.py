"""tf_adacomp: AdaComp gradient compression for TensorFlow/Keras distributed training."""

from setuptools import find_packages, setup

setup(
    name="tf_adacomp",
    version="0.1.0",
    description="AdaComp gradient compression for tf.distribute and Keras 3",
    long_description=open("README.md").read(),
    long_description_content_type="text/markdown",
    # The examples live at the top level (examples/) and install as tf_adacomp.examples,
    # so that `tf-adacomp train NAME` finds them in any installation.
    packages=find_packages(include=["tf_adacomp", "tf_adacomp.*"]) + ["tf_adacomp.examples"],
    package_dir={"tf_adacomp.examples": "examples"},
    python_requires=">=3.10",
    install_requires=[
        "tensorflow>=2.16",
        "keras>=3.0",
        "absl-py",
        "tensorboard",  # tf.summary, for CompressionStats(log_dir=...)
        "numpy",
    ],
    extras_require={
        "examples": ["scikit-learn", "tensorflow-datasets", "matplotlib"],
        "test": ["pytest", "scikit-learn", "tensorflow-datasets", "matplotlib"],
    },
    entry_points={"console_scripts": ["tf-adacomp=tf_adacomp.cli:main"]},
)
