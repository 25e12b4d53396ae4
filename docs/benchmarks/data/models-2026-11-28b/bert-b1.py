"""BERT-base, random weights, batch 1, sequence 128: transformers' BertModel with BertConfig()'s
defaults, or where transformers is missing a torch.nn.TransformerEncoder of its size."""
import torch

torch.manual_seed(0)
try:
    import transformers
except ImportError:
    transformers = None

if transformers is not None:
    IMPLEMENTATION = f"transformers {transformers.__version__} BertModel(BertConfig())"
    model = transformers.BertModel(transformers.BertConfig())
    vocab = model.config.vocab_size
else:
    IMPLEMENTATION = "torch.nn.TransformerEncoder (12 layers, d_model 768, 12 heads, ff 3072, GELU) with embeddings"

    class Bert(torch.nn.Module):
        """BERT-base's shape: word and position embeddings, layer norm, 12 post-norm encoder layers."""

        def __init__(self) -> None:
            super().__init__()
            self.word = torch.nn.Embedding(30522, 768)
            self.position = torch.nn.Embedding(512, 768)
            self.norm = torch.nn.LayerNorm(768, eps=1e-12)
            layer = torch.nn.TransformerEncoderLayer(768, 12, 3072, activation="gelu", batch_first=True,
                                                     layer_norm_eps=1e-12)
            self.encoder = torch.nn.TransformerEncoder(layer, 12, enable_nested_tensor=False)

        def forward(self, input_ids):
            positions = torch.arange(input_ids.shape[1], device=input_ids.device)
            return self.encoder(self.norm(self.word(input_ids) + self.position(positions)))

    model = Bert()
    vocab = 30522
model = model.eval().to(torch.float32)
example_inputs = (torch.randint(0, vocab, (1, 128)),)
