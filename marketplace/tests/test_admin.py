"""The catalog in the admin: "Add" is `catalog_add` (a model from its own GGUF file on the
gateway's disk); a refusal is the form's one-line error, with nothing written."""

from __future__ import annotations

from pathlib import Path

import pytest
from django.contrib.admin.models import ADDITION, LogEntry
from django.contrib.auth import get_user_model
from django.test import Client

from catalog.models import CatalogModel
from catalog.tests.test_catalog_add import TEMPLATE, _tiny_gguf

pytestmark = pytest.mark.django_db

ADD = "/admin/catalog/catalogmodel/add/"


@pytest.fixture(scope="module")
def files(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    folder = tmp_path_factory.mktemp("gguf")
    (folder / "template.jinja").write_text(TEMPLATE)
    return {
        "chat": _tiny_gguf(folder / "chat.gguf", template=TEMPLATE, general_name="tiny chat"),
        "base": _tiny_gguf(folder / "base.gguf", template=None, general_name="tiny base"),
        "template": folder / "template.jinja",
    }


@pytest.fixture
def operator(catalog) -> Client:  # noqa: ANN001
    client = Client()
    client.force_login(get_user_model().objects.create_superuser("ops", "ops@example.com", "pw-long-enough"))
    return client


def form(path: Path, **fields: object) -> dict[str, object]:
    return {
        "path": str(path),
        "name": "tiny-chat",
        "input_price": "0.10",
        "output_price": "0.40",
        "template": "",
        "template_path": "",
        "context_length": "",
        **fields,
    }


class CatalogAddAdminTests:
    def test_the_add_page_asks_for_a_file_on_the_gateways_disk_never_an_upload(self, operator) -> None:
        response = operator.get(ADD)

        page = response.content.decode()
        assert response.status_code == 200 and "Add a catalog model from its GGUF file" in page
        assert 'name="path"' in page and 'type="file"' not in page and "multipart" not in page
        assert 'name="input_price"' in page and 'name="context_length"' in page

    def test_a_good_add_creates_the_entry_from_its_file(self, operator, files, var_dir) -> None:
        response = operator.post(ADD, form(files["chat"], context_length="2048"))

        assert response.status_code == 302 and response["Location"] == "/admin/catalog/catalogmodel/"
        entry = CatalogModel.objects.get(name="tiny-chat")
        assert (entry.architecture, entry.context_length, entry.chat_template) == ("gemma3", 2048, TEMPLATE)
        assert (entry.input_price_ucents, entry.output_price_ucents) == (10, 40)
        assert (var_dir / entry.tokenizer.removeprefix("gguf:")).is_file()
        assert LogEntry.objects.get(object_id=str(entry.pk)).action_flag == ADDITION

    def test_a_file_without_a_template_takes_one_typed_in_the_form(self, operator, files, var_dir) -> None:
        response = operator.post(ADD, form(files["base"], name="tiny-base", template=TEMPLATE, _continue="1"))

        entry = CatalogModel.objects.get(name="tiny-base")
        assert response.status_code == 302 and response["Location"] == f"/admin/catalog/catalogmodel/{entry.pk}/change/"
        assert entry.chat_template == TEMPLATE

    def test_a_file_without_a_template_takes_one_from_a_path(self, operator, files, var_dir) -> None:
        operator.post(ADD, form(files["base"], name="tiny-base", template_path=str(files["template"])))

        assert CatalogModel.objects.get(name="tiny-base").chat_template == TEMPLATE

    def test_the_change_list_still_answers(self, operator, files, var_dir) -> None:
        operator.post(ADD, form(files["chat"]))

        page = operator.get("/admin/catalog/catalogmodel/").content.decode()
        assert "tiny-chat" in page and "gemma-3-270m" in page


class CatalogAddAdminRefusalTests:
    """Each refusal: the add page again (never a 500), the service's one line as the form's error, nothing written."""

    def refused(self, operator: Client, var_dir: Path, fields: dict[str, object]) -> str:
        rows, copies = CatalogModel.objects.count(), sorted((var_dir / "catalog").glob("*"))
        response = operator.post(ADD, fields)

        assert response.status_code == 200
        errors = response.context["adminform"].form.non_field_errors()
        assert len(errors) == 1 and "\n" not in errors[0]
        assert errors[0] in response.content.decode().replace("&#x27;", "'")
        assert CatalogModel.objects.count() == rows
        assert sorted((var_dir / "catalog").glob("*")) == copies  # no vocabulary copy left behind
        return errors[0]

    def test_a_bad_path(self, operator, files, var_dir) -> None:
        assert "absent.gguf: no such file" in self.refused(
            operator, var_dir, form(files["chat"].with_name("absent.gguf"))
        )

    def test_a_file_that_is_not_a_gguf(self, operator, files, var_dir) -> None:
        assert "not a GGUF file" in self.refused(operator, var_dir, form(files["template"]))

    @pytest.mark.parametrize(
        ("field", "price"), [("input_price", "ten cents"), ("output_price", "-1"), ("input_price", "0.001")]
    )
    def test_a_bad_price(self, operator, files, var_dir, field, price) -> None:
        message = self.refused(operator, var_dir, form(files["chat"], **{field: price}))
        assert message.startswith(f"bad {field.split('_')[0]} price:")

    def test_a_name_already_in_the_catalog(self, operator, files, var_dir) -> None:
        message = self.refused(operator, var_dir, form(files["chat"], name="gemma-3-270m"))
        assert message == "gemma-3-270m is already in the catalog"

    def test_a_file_already_in_the_catalog(self, operator, files, var_dir) -> None:
        operator.post(ADD, form(files["chat"]))
        assert "already in the catalog as tiny-chat" in self.refused(
            operator, var_dir, form(files["chat"], name="again")
        )

    def test_a_file_without_a_template_and_none_given(self, operator, files, var_dir) -> None:
        assert "no chat template" in self.refused(operator, var_dir, form(files["base"], name="tiny-base"))

    def test_a_context_longer_than_the_files(self, operator, files, var_dir) -> None:
        assert "the file's own context is 32768" in self.refused(
            operator, var_dir, form(files["chat"], context_length="100000")
        )

    def test_a_template_both_typed_and_named(self, operator, files, var_dir) -> None:
        message = self.refused(
            operator, var_dir, form(files["base"], template=TEMPLATE, template_path=str(files["template"]))
        )
        assert message == "Give the chat template as text or as a file, not both."

    def test_a_staff_member_without_the_add_permission_is_refused(self, files, var_dir, catalog) -> None:
        staff = get_user_model().objects.create_user("staff", "staff@example.com", "pw-long-enough", is_staff=True)
        client = Client()
        client.force_login(staff)

        assert client.get(ADD).status_code == 403
        assert client.post(ADD, form(files["chat"])).status_code == 403
        assert not CatalogModel.objects.filter(name="tiny-chat").exists()
