"""JSON schemas of the kinds real APIs ask for, written for these tests, each with a prompt
that fits it: nested objects, arrays with item bounds, enums, anyOf / oneOf, $ref / $defs,
string formats and patterns, numeric bounds, additionalProperties false, required and optional
fields mixed."""

from __future__ import annotations

from typing import Any, NamedTuple


class Case(NamedTuple):
    name: str
    prompt: str
    schema: dict[str, Any]


def obj(props: dict[str, Any], required: list[str] | None = None, **kw: Any) -> dict[str, Any]:
    """An object schema; every property required unless `required` says otherwise."""
    return {
        "type": "object",
        "properties": props,
        "required": list(props) if required is None else required,
        "additionalProperties": False,
        **kw,
    }


STR = {"type": "string", "maxLength": 40}
NAME = {"type": "string", "minLength": 1, "maxLength": 30}
INT = {"type": "integer"}
BOOL = {"type": "boolean"}
ADDRESS = obj(
    {"street": STR, "city": NAME, "postcode": {"type": "string", "pattern": "^[0-9]{5}$"}}
)

CASES: list[Case] = [
    Case(
        "person",
        "Describe a person named Alice who is 30 years old.",
        obj({"name": NAME, "age": {"type": "integer", "minimum": 0, "maximum": 130}}),
    ),
    Case(
        "city",
        "Give the name and country of the capital of France.",
        obj({"city": NAME, "country": NAME}),
    ),
    Case(
        "book",
        "Describe the book 1984 by George Orwell.",
        obj(
            {
                "title": NAME,
                "author": NAME,
                "year": {"type": "integer", "minimum": 1000, "maximum": 2100},
            }
        ),
    ),
    Case(
        "product",
        "Describe a cheap red pen for an online shop.",
        obj(
            {
                "name": NAME,
                "price": {"type": "number", "minimum": 0, "maximum": 10000},
                "in_stock": BOOL,
            }
        ),
    ),
    Case(
        "weather",
        "Report the weather in London: 15 degrees and cloudy.",
        obj(
            {
                "city": NAME,
                "temperature_c": {"type": "number", "minimum": -90, "maximum": 60},
                "condition": {"enum": ["sunny", "cloudy", "rainy", "snowy"]},
            }
        ),
    ),
    Case(
        "sentiment",
        "Classify the sentiment of: 'I love this phone!'",
        obj(
            {
                "sentiment": {"type": "string", "enum": ["positive", "negative", "neutral"]},
                "confidence": {"type": "number", "minimum": 0, "maximum": 1},
            }
        ),
    ),
    Case(
        "colors",
        "List three primary colours.",
        obj(
            {
                "colors": {
                    "type": "array",
                    "items": {
                        "type": "string",
                        "enum": ["red", "green", "blue", "yellow", "black", "white"],
                    },
                    "minItems": 3,
                    "maxItems": 3,
                }
            }
        ),
    ),
    Case(
        "tags",
        "Suggest between one and four tags for a blog post about cooking pasta.",
        obj(
            {
                "tags": {
                    "type": "array",
                    "items": {"type": "string", "maxLength": 20},
                    "minItems": 1,
                    "maxItems": 4,
                }
            }
        ),
    ),
    Case(
        "primes",
        "List the first five prime numbers.",
        obj(
            {
                "primes": {
                    "type": "array",
                    "items": {"type": "integer", "minimum": 2, "maximum": 100},
                    "minItems": 5,
                    "maxItems": 5,
                }
            }
        ),
    ),
    Case(
        "user_address",
        "Create a user profile for Bob who lives in Paris.",
        obj({"name": NAME, "address": ADDRESS}),
    ),
    Case(
        "order",
        "Create an order with two items: a book and a lamp.",
        obj(
            {
                "order_id": {"type": "string", "pattern": "^ORD-[0-9]{4}$"},
                "items": {
                    "type": "array",
                    "items": obj(
                        {
                            "product": NAME,
                            "quantity": {"type": "integer", "minimum": 1, "maximum": 99},
                        }
                    ),
                    "minItems": 1,
                    "maxItems": 3,
                },
            }
        ),
    ),
    Case(
        "event_date",
        "When is New Year's Day 2025? Give the event and its date.",
        obj({"event": NAME, "date": {"type": "string", "format": "date"}}),
    ),
    Case(
        "meeting",
        "Schedule a meeting on 2024-05-01 at 10:00 UTC.",
        obj({"title": NAME, "start": {"type": "string", "format": "date-time"}}),
    ),
    Case(
        "contact_email",
        "Give the contact details of John at example.com.",
        obj({"name": NAME, "email": {"type": "string", "format": "email"}}),
    ),
    Case(
        "uuid_record",
        "Create a record with a random UUID identifier.",
        obj({"id": {"type": "string", "format": "uuid"}, "label": NAME}),
    ),
    Case(
        "server_ip",
        "Describe a web server with an IPv4 address.",
        obj(
            {
                "hostname": NAME,
                "ip": {"type": "string", "format": "ipv4"},
                "port": {"type": "integer", "minimum": 1, "maximum": 65535},
            }
        ),
    ),
    Case(
        "website",
        "Give the name and home page URL of the Google search engine.",
        obj({"name": NAME, "url": {"type": "string", "format": "uri"}}),
    ),
    Case(
        "phone",
        "Give a US phone number for customer support.",
        obj(
            {
                "department": NAME,
                "phone": {"type": "string", "pattern": "^\\([0-9]{3}\\) [0-9]{3}-[0-9]{4}$"},
            }
        ),
    ),
    Case(
        "sku",
        "Create a product code for a blue t-shirt.",
        obj({"sku": {"type": "string", "pattern": "^[A-Z]{3}-[0-9]{3}$"}, "color": NAME}),
    ),
    Case(
        "rating",
        "Rate the movie Titanic from 1 to 5 stars.",
        obj({"movie": NAME, "stars": {"type": "integer", "minimum": 1, "maximum": 5}}),
    ),
    Case(
        "percent",
        "What share of the Earth is covered by water, in percent?",
        obj({"percent": {"type": "number", "exclusiveMinimum": 0, "exclusiveMaximum": 100}}),
    ),
    Case(
        "optional_fields",
        "Describe a cat called Tom; add its age only if you know it.",
        obj(
            {"name": NAME, "age": {"type": "integer", "minimum": 0, "maximum": 40}, "color": NAME},
            required=["name"],
        ),
    ),
    Case(
        "optional_nickname",
        "Describe the user Alice Smith (nickname optional).",
        obj(
            {"first_name": NAME, "last_name": NAME, "nickname": NAME},
            required=["first_name", "last_name"],
        ),
    ),
    Case(
        "nullable",
        "Describe Jane; her middle name is unknown.",
        obj({"name": NAME, "middle_name": {"anyOf": [NAME, {"type": "null"}]}}),
    ),
    Case(
        "any_of_id",
        "Give an identifier for the invoice.",
        obj(
            {
                "invoice": {
                    "anyOf": [
                        {"type": "integer", "minimum": 1, "maximum": 999999},
                        {"type": "string", "pattern": "^INV[0-9]{3}$"},
                    ]
                }
            }
        ),
    ),
    Case(
        "one_of_shape",
        "Describe a circle of radius 2.",
        obj(
            {
                "shape": {
                    "oneOf": [
                        obj(
                            {
                                "kind": {"const": "circle"},
                                "radius": {"type": "number", "minimum": 0, "maximum": 100},
                            }
                        ),
                        obj(
                            {
                                "kind": {"const": "square"},
                                "side": {"type": "number", "minimum": 0, "maximum": 100},
                            }
                        ),
                    ]
                }
            }
        ),
    ),
    Case(
        "one_of_payment",
        "The customer pays by card ending in 4242.",
        obj(
            {
                "payment": {
                    "oneOf": [
                        obj(
                            {
                                "method": {"const": "card"},
                                "last4": {"type": "string", "pattern": "^[0-9]{4}$"},
                            }
                        ),
                        obj({"method": {"const": "cash"}}),
                    ]
                }
            }
        ),
    ),
    Case(
        "one_of_type",
        "What is the answer to 6 times 7?",
        obj(
            {
                "answer": {
                    "oneOf": [
                        {"type": "integer", "minimum": -1000, "maximum": 1000},
                        {"type": "string", "maxLength": 20},
                    ]
                }
            }
        ),
    ),
    Case(
        "refs",
        "Describe a company with a CEO and a CTO.",
        {
            "$defs": {"person": obj({"name": NAME, "role": {"enum": ["CEO", "CTO", "CFO"]}})},
            **obj(
                {
                    "company": NAME,
                    "ceo": {"$ref": "#/$defs/person"},
                    "cto": {"$ref": "#/$defs/person"},
                }
            ),
        },
    ),
    Case(
        "ref_array",
        "List two employees of a small shop.",
        {
            "$defs": {
                "employee": obj(
                    {"name": NAME, "salary": {"type": "integer", "minimum": 0, "maximum": 1000000}}
                )
            },
            **obj(
                {
                    "employees": {
                        "type": "array",
                        "items": {"$ref": "#/$defs/employee"},
                        "minItems": 2,
                        "maxItems": 2,
                    }
                }
            ),
        },
    ),
    Case(
        "definitions_ref",
        "Give the location of the Eiffel Tower.",
        {
            "definitions": {"coord": {"type": "number", "minimum": -180, "maximum": 180}},
            **obj(
                {
                    "place": NAME,
                    "lat": {"$ref": "#/definitions/coord"},
                    "lon": {"$ref": "#/definitions/coord"},
                }
            ),
        },
    ),
    Case(
        "recursive_tree",
        "Describe a folder 'docs' that holds a file 'a.txt'.",
        {
            "$defs": {
                "node": obj(
                    {
                        "name": NAME,
                        "children": {
                            "type": "array",
                            "items": {"$ref": "#/$defs/node"},
                            "maxItems": 2,
                        },
                    },
                    required=["name"],
                )
            },
            "$ref": "#/$defs/node",
        },
    ),
    Case(
        "nested_deep",
        "Describe a university with one faculty and one department.",
        obj(
            {
                "university": obj(
                    {
                        "name": NAME,
                        "faculty": obj(
                            {
                                "name": NAME,
                                "department": obj(
                                    {
                                        "name": NAME,
                                        "staff": {"type": "integer", "minimum": 1, "maximum": 500},
                                    }
                                ),
                            }
                        ),
                    }
                )
            }
        ),
    ),
    Case(
        "matrix",
        "Write the 2x2 identity matrix.",
        obj(
            {
                "rows": {
                    "type": "array",
                    "items": {
                        "type": "array",
                        "items": {"type": "integer", "minimum": 0, "maximum": 9},
                        "minItems": 2,
                        "maxItems": 2,
                    },
                    "minItems": 2,
                    "maxItems": 2,
                }
            }
        ),
    ),
    Case(
        "tuple_point",
        "Give the point (3, 4) as a labelled pair.",
        obj(
            {
                "point": {
                    "type": "array",
                    "prefixItems": [
                        {"type": "string", "maxLength": 10},
                        {"type": "integer"},
                        {"type": "integer"},
                    ],
                    "items": False,
                }
            }
        ),
    ),
    Case(
        "const_version",
        "Report the API version 2 status as ok.",
        obj({"version": {"const": 2}, "status": {"enum": ["ok", "degraded", "down"]}}),
    ),
    Case(
        "bool_flags",
        "Is Python interpreted and is C compiled?",
        obj({"python_interpreted": BOOL, "c_compiled": BOOL}),
    ),
    Case(
        "type_list",
        "Give the population of Tokyo, or null if unknown.",
        obj(
            {
                "city": NAME,
                "population": {"type": ["integer", "null"], "minimum": 0, "maximum": 10**9},
            }
        ),
    ),
    Case(
        "integer_step",
        "Pick a number of apples that is a multiple of 5, at most 50.",
        obj({"apples": {"type": "integer", "multipleOf": 5, "minimum": 0, "maximum": 50}}),
    ),
    Case(
        "string_lengths",
        "Give a three-letter airport code and the city it serves.",
        obj({"code": {"type": "string", "minLength": 3, "maxLength": 3}, "city": NAME}),
    ),
    Case(
        "translation",
        "Translate 'hello' into French and Spanish.",
        obj({"french": STR, "spanish": STR}),
    ),
    Case(
        "task_list",
        "Make a to-do list with two tasks, each with a priority.",
        obj(
            {
                "tasks": {
                    "type": "array",
                    "items": obj(
                        {"task": STR, "priority": {"enum": ["low", "medium", "high"]}, "done": BOOL}
                    ),
                    "minItems": 2,
                    "maxItems": 2,
                }
            }
        ),
    ),
    Case(
        "extraction",
        "Extract the entities from: 'Marie Curie worked in Paris.'",
        obj(
            {
                "people": {"type": "array", "items": NAME, "maxItems": 3},
                "places": {"type": "array", "items": NAME, "maxItems": 3},
            }
        ),
    ),
    Case(
        "function_call",
        "Call a function to get the weather in Berlin in celsius.",
        obj(
            {
                "function": {"const": "get_weather"},
                "arguments": obj({"location": NAME, "unit": {"enum": ["celsius", "fahrenheit"]}}),
            }
        ),
    ),
    Case(
        "map_scores",
        "Give the scores of the players Ann and Ben.",
        {
            "type": "object",
            "additionalProperties": {"type": "integer", "minimum": 0, "maximum": 100},
            "maxProperties": 3,
        },
    ),
    Case(
        "property_names",
        "Give the stock of the fruits apple and pear.",
        {
            "type": "object",
            "propertyNames": {"pattern": "^[a-z]{1,10}$"},
            "additionalProperties": {"type": "integer", "minimum": 0, "maximum": 1000},
            "minProperties": 1,
            "maxProperties": 3,
        },
    ),
    Case(
        "time_range",
        "Opening hours of a shop: 09:00 to 17:00.",
        obj(
            {
                "opens": {"type": "string", "pattern": "^([01][0-9]|2[0-3]):[0-5][0-9]$"},
                "closes": {"type": "string", "pattern": "^([01][0-9]|2[0-3]):[0-5][0-9]$"},
            }
        ),
    ),
]
# Schemas the engine cannot enforce in full (or that cannot be satisfied): a 400, with the
# reason in its message.
REFUSED: list[tuple[str, dict[str, Any], str]] = [
    (
        "unique_items",
        obj({"ids": {"type": "array", "items": INT, "uniqueItems": True}}),
        "at /properties/ids: `uniqueItems` is not enforced",
    ),
    ("not", obj({"a": {"not": {"type": "string"}}}), "`not`"),
    (
        "if_then",
        {
            **obj({"a": INT, "b": INT}, required=["a"]),
            "if": {"properties": {"a": {"const": 1}}},
            "then": {"required": ["b"]},
        },
        "if",
    ),
    (
        "additional_items",
        {"type": "array", "prefixItems": [INT], "additionalItems": False},
        "`additionalItems` is not a 2020-12 keyword",
    ),
    (
        "remote_ref",
        obj({"a": {"$ref": "https://example.com/schema.json"}}),
        "only references into this schema",
    ),
    ("overlapping_one_of", obj({"a": {"oneOf": [INT, {"type": "number"}]}}), "may both match"),
    ("required_undefined", obj({"a": INT}, required=["a", "b"]), "`b`"),
    ("unknown_type", obj({"a": {"type": "strng"}}), "not a valid JSON Schema"),
    (
        "bool_as_number",
        obj({"a": {"type": "integer", "exclusiveMinimum": True}}),
        "not of type 'number'",
    ),
    # Refused by llguidance itself.
    ("dangling_ref", obj({"a": {"$ref": "#/$defs/missing"}}), "missing"),
    (
        "min_above_max",
        obj({"a": {"type": "integer", "minimum": 5, "maximum": 1}}),
        "nsatisfiable",
    ),
    ("empty_enum", obj({"a": {"enum": []}}), "nsatisfiable"),
    ("bad_pattern", obj({"a": {"type": "string", "pattern": "([a-z"}}), "Unclosed"),
]
# Schemas an earlier engine (xgrammar) half-enforced and so were refused, enforced in full now:
# (name, schema, an instance the schema rejects).
ACCEPTED: list[tuple[str, dict[str, Any], str]] = [
    (
        "dependent_required",
        {**obj({"a": INT, "b": INT}, required=[]), "dependentRequired": {"a": ["b"]}},
        '{"a": 1}',
    ),
    ("all_of", {"allOf": [obj({"a": INT}), {"required": ["a"]}]}, '{"b": 1}'),
    ("number_multiple_of", obj({"x": {"type": "number", "multipleOf": 0.5}}), '{"x": 0.3}'),
    (
        "ref_siblings",
        {"$defs": {"n": INT}, **obj({"a": {"$ref": "#/$defs/n", "minimum": 3}})},
        '{"a": 1}',
    ),
    (
        "any_of_siblings",
        obj({"a": {"type": "integer", "anyOf": [{"minimum": 5}, {"maximum": 0}]}}),
        '{"a": 3}',
    ),
    (
        "pattern_and_length",
        obj({"a": {"type": "string", "pattern": "^[a-z]+$", "maxLength": 5}}),
        '{"a": "abcdefgh"}',
    ),
    ("untyped_bound", obj({"a": {"minimum": 3}}), '{"a": 1}'),
    ("enum_of_wrong_type", obj({"a": {"type": "string", "enum": ["x", 1]}}), '{"a": 1}'),
]
