"""The papers batchbound implements, cited once by title, venue and year. The report's
claims, glossary and figure captions name them by these keys; the README lists the same."""

REFERENCES = {
    "width": "The Effect of Network Width on the Performance of Large-batch Training, "
             "NeurIPS 2018",
    "diversity": "Gradient Diversity: a Key Ingredient for Scalable Distributed Learning, "
                 "AISTATS 2018",
    "slides": "Scaling-up SGD with mini-batches (lecture slides)",
    "inefficiency": "On the Computational Inefficiency of Large Batch Sizes for Stochastic "
                    "Gradient Descent, arXiv 1811.12941, 2018",
    "mccandlish": "McCandlish et al., An Empirical Model of Large-Batch Training, arXiv "
                  "1812.06162, 2018",
}
