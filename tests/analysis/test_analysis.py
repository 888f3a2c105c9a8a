"""Specialisation analysis (paper App. H.5): language identifier, language shares, embedding probe and PCA plot."""

import numpy as np
import pytest

from loramcl.analysis import (
    EMPTY,
    LanguageIdentifier,
    embed,
    evaluate_identifier,
    hypothesis_probe,
    item_split,
    language_shares,
    language_table,
    pca_plot,
)

ENGLISH = [
    "Save changes before closing?",
    "The file could not be opened.",
    "Click here to download the latest version.",
    "Your password must contain at least eight characters.",
    "Are you sure you want to delete this folder?",
    "No results were found for your search.",
    "Please restart the application to apply the update.",
    "Connection to the server was lost.",
    "Select the printer you want to use.",
    "This field is required.",
    "Show hidden files",
    "The download has finished successfully.",
    "You do not have permission to edit this page.",
    "Enter your email address to reset your password.",
    "Would you like to open the settings now?",
]
FRENCH = [
    "Enregistrer les modifications avant de fermer ?",
    "Le fichier n'a pas pu être ouvert.",
    "Cliquez ici pour télécharger la dernière version.",
    "Votre mot de passe doit contenir au moins huit caractères.",
    "Voulez-vous vraiment supprimer ce dossier ?",
    "Aucun résultat n'a été trouvé pour votre recherche.",
    "Veuillez redémarrer l'application pour appliquer la mise à jour.",
    "La connexion au serveur a été perdue.",
    "Sélectionnez l'imprimante que vous souhaitez utiliser.",
    "Ce champ est obligatoire.",
    "Afficher les fichiers cachés",
    "Le téléchargement s'est terminé avec succès.",
    "Vous n'avez pas l'autorisation de modifier cette page.",
    "Saisissez votre adresse e-mail pour réinitialiser votre mot de passe.",
    "Voulez-vous ouvrir les paramètres maintenant ?",
]
GERMAN = [
    "Änderungen vor dem Schließen speichern?",
    "Die Datei konnte nicht geöffnet werden.",
    "Klicken Sie hier, um die neueste Version herunterzuladen.",
    "Ihr Passwort muss mindestens acht Zeichen enthalten.",
    "Möchten Sie diesen Ordner wirklich löschen?",
    "Für Ihre Suche wurden keine Ergebnisse gefunden.",
    "Bitte starten Sie die Anwendung neu, um das Update anzuwenden.",
    "Die Verbindung zum Server wurde unterbrochen.",
    "Wählen Sie den Drucker aus, den Sie verwenden möchten.",
    "Dieses Feld ist erforderlich.",
    "Versteckte Dateien anzeigen",
    "Der Download wurde erfolgreich abgeschlossen.",
    "Sie haben keine Berechtigung, diese Seite zu bearbeiten.",
    "Geben Sie Ihre E-Mail-Adresse ein, um Ihr Passwort zurückzusetzen.",
    "Möchten Sie die Einstellungen jetzt öffnen?",
]
CORPORA = {"en": ENGLISH, "fr": FRENCH, "de": GERMAN}
HELD_OUT = 5  # the last 5 sentences of each language are never trained on


class FixedIdentifier:
    """A fake identifier whose predictions are fixed: the label of a text is looked up in `table`."""

    def __init__(self, table: dict[str, str], labels: list[str]):
        self.table = table
        self.labels = labels

    def predict(self, texts):
        return [self.table[t] for t in texts]


def split(held_out: bool):
    texts, labels = [], []
    for label, sentences in CORPORA.items():
        chosen = sentences[-HELD_OUT:] if held_out else sentences[:-HELD_OUT]
        texts += chosen
        labels += [label] * len(chosen)
    return texts, labels


@pytest.fixture(scope="module")
def identifier():
    return LanguageIdentifier().fit(*split(held_out=False))


# --- language identification -----------------------------------------------------------------------------------


def test_identifier_is_accurate_on_held_out_sentences(identifier):
    assert identifier.labels == ["de", "en", "fr"]
    texts, labels = split(held_out=True)
    report = evaluate_identifier(identifier, texts, labels)
    assert report["num"] == 3 * HELD_OUT
    assert report["accuracy"] >= 0.9, report["confusion"]
    assert sorted(report["per_language"]) == ["de", "en", "fr"]
    # deterministic: a second identifier trained on the same data predicts the same labels
    assert LanguageIdentifier().fit(*split(held_out=False)).predict(texts) == identifier.predict(texts)


def test_identifier_labels_empty_outputs_as_empty(identifier):
    assert identifier.predict(["", "  ", "Fichier introuvable.", "\n"]) == [EMPTY, EMPTY, "fr", EMPTY]
    assert identifier.predict([]) == []


def test_identifier_rejects_bad_training_data():
    with pytest.raises(ValueError, match="2\\+ languages"):
        LanguageIdentifier().fit(["Bonjour", "Merci"], ["fr", "fr"])
    with pytest.raises(ValueError, match="one language label per text"):
        LanguageIdentifier().fit(["Bonjour", "Hallo"], ["fr"])
    with pytest.raises(ValueError, match="empty"):
        LanguageIdentifier().fit(["Bonjour", " "], ["fr", "de"])
    with pytest.raises(ValueError, match="reserved"):
        LanguageIdentifier().fit(["Bonjour", "Hallo"], ["fr", "empty"])
    with pytest.raises(ValueError, match="not trained"):
        LanguageIdentifier().predict(["Hallo"])


def test_evaluate_identifier_counts_by_hand():
    fake = FixedIdentifier({"a": "fr", "b": "de", "c": "fr", "d": EMPTY, "e": "de"}, ["de", "fr"])
    report = evaluate_identifier(fake, ["a", "b", "c", "d", "e"], ["fr", "fr", "de", "de", "de"])
    # right: a (fr), e (de) -> 2 / 5
    assert report["accuracy"] == pytest.approx(2 / 5)
    assert report["num"] == 5
    assert report["per_language"] == {"de": {"accuracy": pytest.approx(1 / 3), "num": 3},
                                      "fr": {"accuracy": pytest.approx(1 / 2), "num": 2}}
    assert report["confusion"] == {"de": {"de": 1, EMPTY: 1, "fr": 1}, "fr": {"de": 1, "fr": 1}}
    with pytest.raises(ValueError, match="one true language per text"):
        evaluate_identifier(fake, ["a", "b"], ["fr"])
    with pytest.raises(ValueError, match="no text"):
        evaluate_identifier(fake, [], [])


# --- language shares per hypothesis ----------------------------------------------------------------------------


def test_language_shares_by_hand():
    fake = FixedIdentifier({"f1": "fr", "f2": "fr", "f3": "fr", "d1": "de", "d2": "de", "e1": "en", "": EMPTY},
                           ["de", "en", "fr"])
    candidates = [["f1", "d1"],   # fr + de: covers both
                  ["f2", ""],     # fr + empty
                  ["d2", "f3"]]   # de + fr: covers both
    shares = language_shares(candidates, fake)
    assert shares["num_items"] == 3
    assert shares["languages"] == ["de", "fr"]  # "en" (the source language) left out by default
    assert shares["labels"] == ["de", "en", "fr", EMPTY]
    assert shares["per_hypothesis"][0] == pytest.approx({"de": 1 / 3, "en": 0.0, "fr": 2 / 3, EMPTY: 0.0})
    assert shares["per_hypothesis"][1] == pytest.approx({"de": 1 / 3, "en": 0.0, "fr": 1 / 3, EMPTY: 1 / 3})
    assert all(sum(row.values()) == pytest.approx(1.0) for row in shares["per_hypothesis"])
    assert shares["majority"] == ["fr", "de"]  # h1: a three-way tie, the first label wins
    assert shares["majority_share"] == pytest.approx([2 / 3, 1 / 3])
    assert shares["both_languages"] == pytest.approx(2 / 3)
    assert shares["predictions"] == [["fr", "de"], ["fr", EMPTY], ["de", "fr"]]
    # an explicit language list: every item has a French candidate
    assert language_shares(candidates, fake, languages=["fr"])["both_languages"] == pytest.approx(1.0)
    assert language_shares([["e1", "f1"]], fake, languages=["en", "de"])["both_languages"] == 0.0

    table = language_table(shares, title="LoRA-MCL K=2")
    lines = table.splitlines()
    assert lines[0] == "LoRA-MCL K=2"
    assert "| hypothesis | de | en | fr | empty | majority |" in lines
    assert "| h0 | 33.3 | 0.0 | 66.7 | 0.0 | fr (66.7) |" in lines
    assert "| h1 | 33.3 | 0.0 | 33.3 | 33.3 | de (33.3) |" in lines
    assert "66.7% of 3" in lines[-1]


def test_language_shares_rejects_bad_input():
    fake = FixedIdentifier({"a": "fr", "b": "de"}, ["de", "fr"])
    with pytest.raises(ValueError, match="same K"):
        language_shares([["a", "b"], ["a"]], fake)
    with pytest.raises(ValueError, match="no items"):
        language_shares([], fake)
    with pytest.raises(ValueError, match="languages="):
        language_shares([["a"]], FixedIdentifier({"a": "en"}, ["en"]))


def test_language_shares_with_the_real_identifier(identifier):
    candidates = [["Le fichier est introuvable.", "Die Datei wurde nicht gefunden."],
                  ["Voulez-vous continuer ?", "Möchten Sie fortfahren?"]]
    shares = language_shares(candidates, identifier)
    assert shares["majority"] == ["fr", "de"] and shares["majority_share"] == [1.0, 1.0]
    assert shares["both_languages"] == 1.0


# --- embedding probe and PCA -----------------------------------------------------------------------------------


def synthetic(num_items=200, num_hypotheses=2, dim=16, shift=0.0, seed=0):
    """[N, K, d]: a shared item vector (the content, off axis 0) + small noise, hypothesis k moved by k * shift
    along axis 0."""
    rng = np.random.default_rng(seed)
    content = rng.normal(size=(num_items, 1, dim)) * 3
    content[:, :, 0] = 0
    noise = rng.normal(size=(num_items, num_hypotheses, dim)) * 0.5
    offsets = np.zeros((1, num_hypotheses, dim))
    offsets[0, :, 0] = shift * np.arange(num_hypotheses)
    return content + noise + offsets


def test_item_split_keeps_each_item_on_one_side():
    train, test = item_split(50, test_size=0.3, seed=1)
    assert len(test) == 15 and len(train) == 35
    assert not set(train) & set(test)
    assert sorted([*train, *test]) == list(range(50))
    assert not np.array_equal(test, np.arange(35, 50))  # shuffled, not the last items
    again_train, again_test = item_split(50, test_size=0.3, seed=1)
    assert np.array_equal(train, again_train) and np.array_equal(test, again_test)
    assert len(item_split(2, test_size=0.01)[1]) == 1  # at least one item on each side
    with pytest.raises(ValueError, match="at least 2 items"):
        item_split(1)
    with pytest.raises(ValueError, match="test_size"):
        item_split(10, test_size=1.0)


def test_probe_finds_specialised_hypotheses_and_not_noise():
    specialised = hypothesis_probe(synthetic(shift=3.0, num_hypotheses=3), seed=0)
    assert specialised["accuracy"] > 0.95
    assert specialised["num_hypotheses"] == 3
    assert specialised["chance"] == pytest.approx(1 / 3)
    assert specialised["num_train"] + specialised["num_test"] == 200 * 3
    assert specialised["num_test"] == 60 * 3  # 30% of the items, all their candidates

    noise = hypothesis_probe(synthetic(shift=0.0), seed=0)
    assert noise["accuracy"] < 0.7
    assert noise["chance"] >= 0.5


def test_probe_mask_and_bad_input():
    embeddings = synthetic(num_items=40, num_hypotheses=2, shift=3.0)
    mask = np.ones((40, 2), dtype=bool)
    mask[:10, 1] = False  # e.g. 10 empty outputs of h1
    result = hypothesis_probe(embeddings, mask=mask)
    assert result["num_train"] + result["num_test"] == 70
    with pytest.raises(ValueError, match="reshape"):
        hypothesis_probe(embeddings.reshape(80, -1))
    with pytest.raises(ValueError, match="mask has shape"):
        hypothesis_probe(embeddings, mask=np.ones((40, 3), dtype=bool))
    with pytest.raises(ValueError, match="K >= 2"):
        hypothesis_probe(embeddings[:, :1])
    only_h0 = np.zeros((40, 2), dtype=bool)
    only_h0[:, 0] = True
    with pytest.raises(ValueError, match="1 hypothesis"):
        hypothesis_probe(embeddings, mask=only_h0)


def test_pca_plot_writes_a_png(tmp_path):
    embeddings = synthetic(num_items=30, num_hypotheses=2, shift=3.0)
    result = pca_plot(embeddings, tmp_path / "plots" / "pca.png", title="h0 vs h1")
    path = tmp_path / "plots" / "pca.png"
    assert result["path"] == str(path)
    assert path.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    first, second = result["explained_variance"]
    assert 0 < second <= first <= 1

    languages = np.array([["fr", "de"]] * 30, dtype=object)
    by_language = pca_plot(embeddings, tmp_path / "lang.png", colours_by=languages, label_names=["de", "fr", "empty"])
    assert (tmp_path / "lang.png").exists()
    assert by_language["explained_variance"] == pytest.approx(result["explained_variance"])
    with pytest.raises(ValueError, match="missing from label_names"):
        pca_plot(embeddings, tmp_path / "x.png", colours_by=languages, label_names=["de"])
    with pytest.raises(ValueError, match="label_names"):
        pca_plot(embeddings, tmp_path / "x.png", label_names=["only one"])


def test_embed_with_the_packaged_minilm():
    vectors = embed(["Save the file.", "Store the file.", "The cat sleeps on the sofa."])
    assert vectors.shape == (3, 384) and vectors.dtype == np.float32
    assert np.linalg.norm(vectors, axis=1) == pytest.approx(1.0, abs=1e-5)
    similarity = vectors @ vectors.T
    assert similarity[0, 1] > similarity[0, 2] + 0.2
    with pytest.raises(ValueError, match="at least one"):
        embed([])
