"""Where each dataset comes from, and the checksum that proves a copy is the published one.

One :class:`Source` per registered dataset that protofl can fetch or tell you how to
place: its files, each with the URLs it is published at (the publisher first, then
known mirrors) and the checksum its publisher or torchvision's dataset code pins
(MD5 for the older archives, SHA-256 where the publisher gives that). Files land in
``<data root>/<folder>/<file name>``, exactly where the loaders in
:mod:`protofl.data.datasets` look, and the loaders read them as they are (no unpacking
step that could be left half done).

A mirror (``data.mirrors``, ``PROTOFL_DATA_MIRROR``) is a base URL laid out like the data
root: ``<mirror>/<folder>/<file name>``, so a copy of a data root served over HTTP (or a
local folder, as ``file://...``) is a mirror. Mirrors are tried before the publisher.

Nothing here is read at import time of the loaders; tests build their own :class:`Source`
with the checksums of their tiny files (see ``tests/test_fetch.py``).
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import cast, Optional


@dataclass(frozen=True)
class RemoteFile:
    name: str  # file name under the dataset's folder
    urls: tuple[str, ...]  # where it is published, in the order tried
    md5: Optional[str] = None
    sha256: Optional[str] = None
    size: Optional[int] = None  # bytes, where the publisher states it

    @property
    def known_hash(self) -> Optional[str]:
        """The checksum in pooch's ``algorithm:hex`` form (the stronger one when both are pinned)."""
        if self.sha256:
            return f"sha256:{self.sha256}"
        if self.md5:
            return f"md5:{self.md5}"
        return None


@dataclass(frozen=True)
class Source:
    name: str  # the dataset's registry name (``data.name``)
    title: str
    homepage: str
    license: str
    folder: str  # under the data root
    files: tuple[RemoteFile, ...] = ()
    size: str = ""  # what the files take, for people, where their byte counts are not pinned
    checksum_from: str = ""  # who publishes the pinned checksums
    # why it cannot be fetched (empty: it can), and how to place it by hand
    not_fetchable: str = ""
    by_hand: str = ""
    # other layouts a hand-placed copy may have (glob patterns relative to the data root): any
    # of these present counts as present, though the archives' checksums cannot be checked then
    also_present_as: tuple[str, ...] = ()
    note: str = ""
    extra: dict = field(default_factory=dict)

    @property
    def fetchable(self) -> bool:
        return not self.not_fetchable and bool(self.files) and all(f.known_hash for f in self.files)

    @property
    def total_bytes(self) -> Optional[int]:
        sizes = [f.size for f in self.files]
        return sum(cast(list[int], sizes)) if sizes and all(s is not None for s in sizes) else None

    @property
    def size_text(self) -> str:
        """What the files take, in the units a download shows (decimal MB): from their pinned
        byte counts where every file has one, else the catalog's words."""
        from ..errors import human_bytes

        return human_bytes(self.total_bytes) if self.total_bytes is not None else self.size or "size unknown"

    def how_to_place(self, root) -> str:
        """One sentence: where the files go and where to get them."""
        where = f"{root}/{self.folder}" if root is not None else f"<data root>/{self.folder}"
        if self.by_hand:
            return f"{self.by_hand} into {where}"
        files = ", ".join(f"{f.urls[0]} ({_hash_text(f)})" for f in self.files)
        return f"download {files} into {where}"


def _hash_text(f: RemoteFile) -> str:
    return f"sha256 {f.sha256}" if f.sha256 else f"md5 {f.md5}" if f.md5 else "no pinned checksum"


def _files(names_md5: dict[str, str], *bases: str, sizes: Optional[dict[str, int]] = None) -> tuple[RemoteFile, ...]:
    return tuple(RemoteFile(n, tuple(b + n for b in bases), md5=m, size=(sizes or {}).get(n))
                 for n, m in names_md5.items())


# ---------------------------------------------------------------------------------------
# The catalog. MD5s: torchvision's dataset code (mnist.py, cifar.py, svhn.py, usps.py)
# unless said otherwise; sizes: the published files' byte counts where known.
# ---------------------------------------------------------------------------------------
_MNIST_MD5 = {
    "train-images-idx3-ubyte.gz": "f68b3c2dcbeaaa9fbdd348bbdeb94873",
    "train-labels-idx1-ubyte.gz": "d53e105ee54ea40749a09fcbcd1e9432",
    "t10k-images-idx3-ubyte.gz": "9fb629c4189551a2d022fa330f9573f3",
    "t10k-labels-idx1-ubyte.gz": "ec29112dd5afa0611ce80d1b7f02629c",
}
_FMNIST_MD5 = {
    "train-images-idx3-ubyte.gz": "8d4fb7e6c68d591d4c3dfef9ec88bf0d",
    "train-labels-idx1-ubyte.gz": "25c81989df183df01b3e8a0aad5dffbe",
    "t10k-images-idx3-ubyte.gz": "bef4ecab320f06d8554ea6380940ec79",
    "t10k-labels-idx1-ubyte.gz": "bb300cfdad3c16e7a12a480ee83cd310",
}
_SHAKESPEARE_REV = "4e428b13388c9f78fa772ab039d056f69c639a62"  # flwrlabs/shakespeare "Upload shakespeare.csv"

SOURCES: tuple[Source, ...] = (
    Source(
        "mnist", "MNIST", "http://yann.lecun.com/exdb/mnist/", "no license stated on the homepage (Y. LeCun, C. Cortes); often cited as CC BY-SA 3.0", "mnist",
        # torchvision's two mirrors; the S3 copy first: LeCun's site often refuses plain downloads
        _files(_MNIST_MD5, "https://ossci-datasets.s3.amazonaws.com/mnist/", "http://yann.lecun.com/exdb/mnist/",
               sizes={"train-images-idx3-ubyte.gz": 9912422, "train-labels-idx1-ubyte.gz": 28881,
                      "t10k-images-idx3-ubyte.gz": 1648877, "t10k-labels-idx1-ubyte.gz": 4542}),
        checksum_from="torchvision (torchvision/datasets/mnist.py)",
        also_present_as=("MNIST/raw/train-images-idx3-ubyte",),
    ),
    Source(
        "fmnist", "Fashion-MNIST", "https://github.com/zalandoresearch/fashion-mnist", "MIT (Zalando Research)",
        "fashion-mnist",
        _files(_FMNIST_MD5, "http://fashion-mnist.s3-website.eu-central-1.amazonaws.com/",
               sizes={"train-images-idx3-ubyte.gz": 26421880, "train-labels-idx1-ubyte.gz": 29515,
                      "t10k-images-idx3-ubyte.gz": 4422102, "t10k-labels-idx1-ubyte.gz": 5148}),
        checksum_from="torchvision (mnist.py, FashionMNIST) and Zalando's README",
        also_present_as=("fmnist/train-images-idx3-ubyte.gz", "FashionMNIST/raw/train-images-idx3-ubyte"),
    ),
    Source(
        "emnist", "EMNIST (all six splits in one archive)", "https://www.nist.gov/itl/products-and-services/emnist-dataset",
        "NIST terms, no license stated (cite Cohen et al. 2017)", "emnist",
        (RemoteFile("gzip.zip", ("https://biometrics.nist.gov/cs_links/EMNIST/gzip.zip",
                                 "https://www.itl.nist.gov/iaui/vip/cs_links/EMNIST/gzip.zip"),
                    md5="58c8d27c78d21e728a6bc7b3cc06412e"),),
        size="536 MB", checksum_from="torchvision (mnist.py, EMNIST)",
        note="data.split picks the split (byclass by default); read straight from the zip",
    ),
    Source(
        "cifar10", "CIFAR-10", "https://www.cs.toronto.edu/~kriz/cifar.html", "no license stated (A. Krizhevsky); cite the tech report",
        "cifar10",
        (RemoteFile("cifar-10-python.tar.gz", ("https://www.cs.toronto.edu/~kriz/cifar-10-python.tar.gz",),
                    md5="c58f30108f718f92721af3b95e74349a", size=170498071),),
        checksum_from="torchvision (cifar.py) and the publisher's page",
        also_present_as=("cifar10/cifar-10-batches-py/test_batch", "cifar-10-batches-py/test_batch"),
        note="read straight from the tarball (or from an extracted cifar-10-batches-py/)",
    ),
    Source(
        "cifar100", "CIFAR-100", "https://www.cs.toronto.edu/~kriz/cifar.html", "no license stated (A. Krizhevsky); cite the tech report",
        "cifar100",
        (RemoteFile("cifar-100-python.tar.gz", ("https://www.cs.toronto.edu/~kriz/cifar-100-python.tar.gz",),
                    md5="eb9058c3a382ffc7106e4002c42a8d85", size=169001437),),
        checksum_from="torchvision (cifar.py) and the publisher's page",
        also_present_as=("cifar100/cifar-100-python/test", "cifar-100-python/test"),
    ),
    Source(
        "svhn", "SVHN (cropped digits, train + test)", "http://ufldl.stanford.edu/housenumbers/",
        "non-commercial use only (Netzer et al. 2011)", "svhn",
        _files({"train_32x32.mat": "e26dedcc434d2e4c54c9b2d4a06d8373", "test_32x32.mat": "eb5a983be6a315427106f1b164d9cef3"},
               "http://ufldl.stanford.edu/housenumbers/",
               sizes={"train_32x32.mat": 182040794, "test_32x32.mat": 64275384}),
        checksum_from="torchvision (svhn.py)", note="extra_32x32.mat (1.3 GB) is not fetched",
    ),
    Source(
        "tinyimagenet", "Tiny-ImageNet-200", "http://cs231n.stanford.edu/", "ImageNet terms: non-commercial research",
        "tinyimagenet",
        (RemoteFile("tiny-imagenet-200.zip", ("http://cs231n.stanford.edu/tiny-imagenet-200.zip",),
                    md5="90528d7ca1a48142e341f4ef8d21d0de"),),
        size="237 MB",
        checksum_from="third-party loaders (the MD5 the FGVC and Avalanche TinyImageNet classes pin); "
                      "Stanford publishes none",
        also_present_as=("tinyimagenet/tiny-imagenet-200/wnids.txt", "tiny-imagenet-200/wnids.txt"),
        note="validation labels from val/val_annotations.txt; read straight from the zip",
    ),
    Source(
        "usps", "USPS (Digit-5 domain)", "https://www.csie.ntu.edu.tw/~cjlin/libsvmtools/datasets/multiclass.html#usps",
        "no license stated (LIBSVM data page); research use", "usps",
        _files({"usps.bz2": "ec16c51db3855ca6c91edd34d0e9b197", "usps.t.bz2": "8ea070ee2aca1ac39742fdd1ef5ed118"},
               "https://www.csie.ntu.edu.tw/~cjlin/libsvmtools/datasets/multiclass/"),
        size="8 MB", checksum_from="torchvision (usps.py)",
    ),
    Source(
        "mnistm", "MNIST-M (Digit-5 domain)", "https://github.com/liyxi/mnist-m", "derived from MNIST and BSDS500; research use",
        "mnistm",
        _files({"mnist_m_train.pt.tar.gz": "191ed53db9933bd85cc9700558847391",
                "mnist_m_test.pt.tar.gz": "e11cb4d7fff76d7ec588b1134907db59"},
               "https://github.com/liyxi/mnist-m/releases/download/data/"),
        size="about 40 MB", checksum_from="the publisher's loader (liyxi/mnist-m, mnist_m.py)",
    ),
    Source(
        "synthdigits", "SynthDigits (Digit-5 domain; Ganin & Lempitsky's synthetic numbers)",
        "https://github.com/liyxi/synthetic-digits", "research use (released with Ganin & Lempitsky 2015)",
        "synthdigits",
        _files({"synth_train.pt.gz": "d0e99daf379597e57448a89fc37ae5cf", "synth_test.pt.gz": "669d94c04d1c91552103e9aded0ee625"},
               "https://github.com/liyxi/synthetic-digits/releases/download/data/"),
        size="about 60 MB", checksum_from="the publisher's loader (liyxi/synthetic-digits, synthetic_digits.py)",
    ),
    Source(
        "shakespeare", "Shakespeare (LEAF, one user per play and role)", "https://huggingface.co/datasets/flwrlabs/shakespeare",
        "BSD 2-Clause (LEAF)", "shakespeare",
        (RemoteFile("shakespeare.csv",
                    (f"https://huggingface.co/datasets/flwrlabs/shakespeare/resolve/{_SHAKESPEARE_REV}/shakespeare.csv",),
                    sha256="5c74050549811603d3bcccd428fed6318eb2c5491cdade24f3091467eea1ce3e", size=505874193),),
        checksum_from=f"the Hugging Face Hub's Git LFS pointer of flwrlabs/shakespeare at revision {_SHAKESPEARE_REV}",
        note="LEAF's samples per user, no LEAF preprocessing needed; each user's last 10% of samples are the test split",
        also_present_as=("shakespeare/train", "shakespeare/data/train", "shakespeare/*.tar.gz"),
    ),
    Source(
        "femnist", "FEMNIST (LEAF, one user per writer)", "https://leaf.cmu.edu/", "BSD 2-Clause (LEAF); NIST SD 19 data",
        "femnist",
        not_fetchable="no stable copy with a published checksum is pinned yet (the Hugging Face copy "
                      "flwrlabs/femnist is parquet without a checksum we could verify)",
        by_hand="run LEAF's preprocessing (./preprocess.sh -s niid --sf 0.05 -k 0 -t sample in leaf/data/femnist) "
                "and copy data/train/ and data/test/ (or a .tar.gz holding them)",
        also_present_as=("femnist/train", "femnist/data/train", "femnist/*.tar.gz", "femnist/data/*.tar.gz"),
    ),
    Source(
        "domainnet", "DomainNet (6 domains, 345 classes)", "http://ai.bu.edu/M3SDA/", "research use (Peng et al. 2019)",
        "domainnet",
        not_fetchable="too large to fetch on first use (about 20 GB) and no loader in protofl yet",
        by_hand="download the six domains' zips and split files from the homepage",
    ),
    Source(
        "fed_isic2019", "Fed-ISIC2019 (FLamby)", "https://github.com/owkin/FLamby", "ISIC terms: you must accept them yourself",
        "fed_isic2019",
        not_fetchable="its license must be accepted by you on the ISIC archive, and no loader in protofl yet",
        by_hand="follow FLamby's fed_isic2019 download instructions",
    ),
)

CATALOG: dict[str, Source] = {s.name: s for s in SOURCES}
